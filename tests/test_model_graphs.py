"""Host steps of a captured forward: run at capture, recorded, and outside a capture only run.

A device graph replays device work only; the expert header check is host work, so the forward
registers it through `graphs.host_step` and `GraphRunner.replay` re-runs it before each replay.
"""

from runner_fsm.replica import graphs


def test_host_step_is_recorded_only_while_capturing():
    calls = []

    def check(step_id):
        calls.append(step_id)

    with graphs.capturing_host_steps() as recorded:
        graphs.host_step(check, 3)
    graphs.host_step(check, 4)
    assert calls == [3, 4]
    assert recorded == [check]  # the second call ran but was not recorded
