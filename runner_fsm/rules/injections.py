"""An injected fault that never acted tested nothing: `injection_not_fired`, judged from the logs.

Each rank's `job` record names the job's injections (`inject`, `KIND@replica=R,step=S`), and the
rank where one acts writes an `injected` record at that moment (`faults.Injector`, the vLLM
worker's `VLLMInjector`). An injection no rank logged as acting is a finding, whether the run
ended by itself, was stopped, or died: the evidence is on disk either way, unlike a report the
runner could make only at its shutdown.
"""

from __future__ import annotations

from runner_fsm.faults import parse_target
from runner_fsm.rules.facts import RunFacts
from runner_fsm.rules.verdicts import Verdict


def _key(text: str) -> tuple[str, tuple[int, int] | None]:
    return text.strip().partition("@")[0], parse_target(text)


def check_injections(facts: RunFacts) -> list[Verdict]:
    named = sorted({text.strip() for texts in facts.injections.values() for text in texts})
    fired = {_key(text) for _, _, text in facts.fired}
    verdicts = []
    for text in named:
        kind, target = _key(text)
        if (kind, target) in fired:
            continue
        replica, step = target if target is not None else (None, None)
        ranks = tuple(sorted(r for r, end in facts.ends.items() if end.replica == replica))
        verdicts.append(Verdict("injection_not_fired", replica, step,
                                f"inject {text} never fired (no rank logged it acting): {_why(facts, replica, step)};"
                                " the run tested nothing", ranks))
    return verdicts


def _why(facts: RunFacts, replica: int | None, step: int | None) -> str:
    if replica is None:
        return "it names no replica and step (expected KIND@replica=R,step=S)"
    ends = [end.step for end in facts.ends.values() if end.replica == replica]
    if not ends:
        return f"replica {replica} left no log"
    ran = facts.kinds.get((replica, step))
    if (replica, step) not in facts.kinds and max(ends) < step:
        return f"replica {replica}'s log ends at step {max(ends)}, before step {step}"
    if ran is None:
        return f"replica {replica} began no step of a known kind at step {step}"
    return f"replica {replica} ran a {ran} step at step {step}"
