"""PyTorch's Flight Recorder in the vLLM worker: recording from the start, dumped beside the log.

`FSMWorker.init_device` calls `start()` before vLLM's `init_distributed_environment` (torch
reads `TORCH_FR_BUFFER_SIZE` when the process makes its first process group), then
`WorkerFlight(run_dir, global_rank, parallel_config)` once vLLM's groups exist. The worker
dumps on a fault (`fault`), the DP watchdog on a collective timeout (`timeout`, from its
thread, while the main thread is still blocked in gloo), and the worker at shutdown (`end`).
Each dump replaces the last, so the file holds the latest buffer; a dump after a fault or a
timeout keeps that reason.

The audit log names the DP agreement's group `dp` (`dp/agreement.py`: the collective vLLM's
`_run_ar` issues, rows appended); `groups()` maps that name to the very process group the
agreement runs on (`dp_utils._get_device_and_group`, as vLLM picks it), so `runner-fsm replay`
joins the dumps to the audit records by group and sequence number.

In vLLM's in-process mode (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the offline SPMD recipe) the
engine makes its own DP group before the worker exists, so the buffer size is fixed by then:
torch 2.13 records gloo collectives by default (2000 entries, as `start()` would set). To turn
recording off there, set `RUNNER_FSM_FLIGHT_RECORDER=0` (or `TORCH_FR_BUFFER_SIZE=0`) in the
environment the job starts with; `RUNNER_FSM_FLIGHT_RECORDER=0` always stops the dumps.
"""

from __future__ import annotations

import sys
from typing import Any

from runner_fsm.process import flight_recorder


def start(entries: int = flight_recorder.DEFAULT_BUFFER_SIZE) -> bool:
    """Before vLLM creates its process groups: the recorder on with a ring of `entries`, unless
    turned off (a log cap keeps the dump within its share: `audit.segments.flight_entries`)."""
    return flight_recorder.enable(entries)


def groups(parallel_config: Any, adapter: Any) -> dict[str, Any]:
    """{audit group name: process group} for this worker when DP > 1: `dp`, the group the DP
    agreement runs on (where the runner's adapter says its DP sync all-reduces); `expert`, the DP
    group's device group, where vLLM's naive DP MoE exchange runs
    (`AgRsAll2AllManager._get_comm_group` is the DP group without PCP; its communicator's
    `all_gatherv`, `cpu/collectives.py` on the CPU). Should both be one group, it is named `dp`."""
    if int(parallel_config.data_parallel_size) <= 1:
        return {}
    from vllm.distributed.parallel_state import get_dp_group

    _device, agreement = adapter.dp_group()
    return {"expert": get_dp_group().device_group, "dp": agreement}


class WorkerFlight:
    """Writes this rank's `fr-rank-<global_rank>.json`; `dump` never raises."""

    def __init__(self, run_dir: str | None = None, global_rank: int = 0, groups: dict[str, Any] | None = None):
        self.run_dir, self.global_rank = run_dir, int(global_rank)
        self.groups = groups or {}
        self.reason: str | None = None  # the first fault or timeout, kept by later dumps

    def dump(self, reason: str) -> None:
        if self.run_dir is None:
            return
        if reason != "end" and self.reason is None:
            self.reason = reason
        try:
            flight_recorder.dump_beside(self.run_dir, self.global_rank, self.groups, self.reason or reason)
        except Exception as exc:  # noqa: BLE001 - a failed dump must not hide the step's own error
            print(f"runner_fsm: Flight Recorder dump of rank {self.global_rank} failed: {exc!r}",
                  file=sys.stderr, flush=True)
