"""What one rank of the embedded engine reports to its launcher.

Apart from the rank's code (`engine.worker`), so that the launcher reads reports without
importing torch: only the ranks need it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What one rank reports back: its replica's outputs, counts and the error, if any."""

    global_rank: int
    dp_rank: int
    pcp_rank: int
    outputs: dict[str, list[int]]
    num_steps: int
    num_real_steps: int
    num_preemptions: int
    num_tokens: int  # tokens this replica scheduled (prompt and verify rows)
    elapsed_s: float
    steps_per_state: dict[str, int]  # prefill / decode / idle_dummy steps of this replica
    num_handoffs: int  # real steps followed by an idle_dummy step
    num_agreements: int
    error: dict | None = None
    # This replica's injections that never applied, with why; None from a rank that died unheard.
    not_fired: dict[str, str] | None = None
