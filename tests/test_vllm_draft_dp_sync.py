"""`draft_dp_sync` (runner_fsm/integrations/vllm/runners/draft_dp_sync.py) at function level: where it
installs, what it changes in the speculator's call, and why it refuses elsewhere. End to end
(DP=2 x PCP=2 with MTP through vLLM) it is tests/test_vllm_mtp_pcp_dp.py."""

from __future__ import annotations

import pytest

from runner_fsm.integrations.vllm.runners import draft_dp_sync

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]


def _speculator(**overrides):
    """An MTP speculator object that never ran vLLM's constructor, its `propose` a recorder."""
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

    cls = type("Probe", (MTPSpeculator,), overrides)
    spec = object.__new__(cls)
    calls = []
    spec.propose = lambda *args, **kwargs: calls.append((args, kwargs)) or "drafted"
    return spec, calls


def test_the_installed_vllm_is_the_one_whose_draft_path_fails():
    """The digests pinned are the installed vLLM's: a vLLM that changed any of these functions
    gets no change from here (and this test says so first)."""
    import vllm

    assert draft_dp_sync.pinned_problems(vllm.__version__) == []


def test_installed_the_speculator_takes_its_own_dp_syncs():
    """Mutation: the wrapper passes `dp_sync_state` through -> the target's agreement reaches vLLM."""
    import vllm

    spec, calls = _speculator()
    done = draft_dp_sync.install(spec, dp_size=2, pcp_size=2, version=vllm.__version__)
    assert done["installed"] is True and "dp_sync_state=None" in done["action"], done
    assert set(done["pinned"]) == {name for _, name in draft_dp_sync.PINNED["0.32.0"]}
    target_state = object()
    # as vLLM's two callers pass it: by keyword (sample_tokens, _dummy_run) ...
    assert spec.propose("batch", dp_sync_state=target_state, dummy_run=True) == "drafted"
    # ... or positionally, as the 12th argument after self
    args = tuple(range(11)) + (target_state, False)
    spec.propose(*args)
    assert calls[0] == (("batch",), {"dp_sync_state": None, "dummy_run": True})
    assert calls[1][0] == tuple(range(11)) + (None, False)
    again = draft_dp_sync.install(spec, dp_size=2, pcp_size=2, version=vllm.__version__)
    assert again["installed"] is True
    spec.propose("batch", dp_sync_state=target_state)
    assert len(calls) == 3  # installed once: one wrapper, one call


@pytest.mark.parametrize("dp_size, pcp_size", [(1, 2), (2, 1), (1, 1)])
def test_left_to_vllm_where_its_reuse_is_sound(dp_size, pcp_size):
    import vllm

    spec, calls = _speculator()
    done = draft_dp_sync.install(spec, dp_size=dp_size, pcp_size=pcp_size, version=vllm.__version__)
    assert done == {"installed": False, "reason": f"DP={dp_size} x PCP={pcp_size}: vLLM's reuse of the"
                                                  " target's DP sync fails only under DP x PCP"}
    spec.propose(dp_sync_state="target's")
    assert calls == [((), {"dp_sync_state": "target's"})]


def test_left_to_vllm_for_another_vllm_or_speculator(monkeypatch, capsys):
    spec, _ = _speculator()
    other = draft_dp_sync.install(spec, dp_size=2, pcp_size=2, version="0.34.0")
    assert other["installed"] is False
    assert "vLLM 0.34.0: no pins for this release (pinned: 0.32.0, 0.33.0)" in other["reason"]
    # 0.33.0's pins are its own source's: the installed 0.32 source does not match them
    other = draft_dp_sync.install(spec, dp_size=2, pcp_size=2, version="0.33.0")
    assert "TargetDependentARSpeculator.propose: source digest 55c66c96992f7eca, pinned 7e919b6a89f0ae05" \
        in other["reason"]
    # Pins that hold on a release the reproduction never ran on: off, said on stderr
    monkeypatch.setitem(draft_dp_sync.PINNED, "0.33.0", draft_dp_sync.PINNED["0.32.0"])
    monkeypatch.setattr(draft_dp_sync, "_warned", set())
    capsys.readouterr()
    unverified = draft_dp_sync.install(spec, dp_size=2, pcp_size=2, version="0.33.0")
    assert unverified["installed"] is False and "has not run on it (verified: 0.32.0)" in unverified["reason"]
    assert "runner_fsm: draft_dp_sync is off: vLLM 0.33.0 matches its pins" in capsys.readouterr().err
    assert not getattr(spec, "_runner_fsm_draft_dp_sync", False)
    overriding, _ = _speculator(propose=lambda self, *a, **k: None)
    assert "overrides propose" in draft_dp_sync.install(overriding, dp_size=2, pcp_size=2, version="0.32.0")["reason"]
    assert "is not a TargetDependentARSpeculator" in draft_dp_sync.install(
        object(), dp_size=2, pcp_size=2, version="0.32.0")["reason"]
