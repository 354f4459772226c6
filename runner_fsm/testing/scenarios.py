"""Scripted multi-process runs of the real runner with the fake model (tests, benchmarks).

`run_script` is the per-rank entry for `runner_fsm.engine.launch.spawn`: each rank drives
its replica through a script of steps, in which each replica either works or idles.
"""

from __future__ import annotations

import anyio

from runner_fsm.config import ParallelLayout, RunnerConfig
from runner_fsm.dp import GlooAgreement
from runner_fsm.engine.groups import ProcessGroups
from runner_fsm.events import Capture, DummyStep, RealStep, Shutdown
from runner_fsm.faults import Injection, Injector
from runner_fsm.testing.fakes import FakeModel
from runner_fsm.testing.harness import decode_batch, make_runner, prefill_batch

HANDOFF_LAYOUT = ParallelLayout(dp_size=2, pcp_size=2)
# replica 0 prefills, then decodes, while replica 1 idles; then both idle; then the reverse
HANDOFF_SCRIPT = [
    (("prefill", [9, 4]), None),
    (("decode", [9, 4]), None),
    (None, None),
    (None, ("prefill", [5])),
]


def _event(work):
    if work is None:
        return DummyStep()
    kind, sizes = work
    return RealStep(prefill_batch(sizes) if kind == "prefill" else decode_batch(sizes))


def run_script(groups: ProcessGroups, run_dir: str, config_kwargs: dict, script: list,
               injections: tuple[str, ...] = ()) -> dict:
    """Run `script` (per step, per replica: None to idle or ("prefill"|"decode", sizes))."""
    config = RunnerConfig(layout=groups.layout, **config_kwargs)
    runner = make_runner(
        config, GlooAgreement(groups.dp, config.capture_sizes), run_dir=run_dir,
        model=FakeModel(groups.pcp), dp_rank=groups.dp_rank, pcp_rank=groups.pcp_rank,
        injector=Injector(Injection.parse(i) for i in injections),
    )

    async def main() -> dict:
        outputs, error = [], None
        try:
            await runner.handle(Capture())
            for step in script:
                out = await runner.handle(_event(step[groups.dp_rank]))
                outputs.append({"step": out.step_id, "rows": out.num_rows, "sampled": out.sampled,
                                "all_idle": out.agreed.all_idle})
            await runner.handle(Shutdown("script done"))
        except Exception as exc:  # reported as data: the test asserts on it
            error = {"type": type(exc).__name__, "message": str(exc)}
        finally:
            await runner.close()
        return {"outputs": outputs, "error": error, "state": runner.machine.state.value}

    return anyio.run(main)
