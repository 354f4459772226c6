"""One error hierarchy for the whole runner.

Every message names what was expected and what came, and where it is known the replica
(DP rank) and the step, so that a line in a log is enough to find the culprit.
"""

from __future__ import annotations


class RunnerError(Exception):
    """Base of every error the runner raises on purpose."""


class ConfigError(RunnerError, ValueError):
    """The configuration or the parallel layout is inconsistent."""


class BatchError(RunnerError, ValueError):
    """A scheduled batch is malformed; raised before any state is changed."""


class DesyncError(RunnerError):
    """Replicas disagree on the step id or phase of a collective they all joined.

    `sent` maps each DP rank to the (step_id, phase) it sent; `culprits` are the replicas
    out of order and `culprit_step` the step they went wrong in (`agree.order`; empty and None
    on a tie, or where the raiser does not know).
    """

    def __init__(self, message: str, sent: dict[int, tuple[int, int]] | None = None, *,
                 culprits: tuple[int, ...] = (), culprit_step: int | None = None):
        super().__init__(message)
        self.sent = dict(sent or {})
        self.culprits, self.culprit_step = tuple(culprits), culprit_step


class CollectiveTimeout(RunnerError):
    """A collective did not finish within the configured time."""


class StaleBufferError(RunnerError):
    """A graph replay would read persistent buffers not refreshed for this step."""


class StaleContextError(RunnerError):
    """A dummy step would run with a PCP attention context not built from the dummy."""


class ReplicaFault(RunnerError):
    """A replica reported a non-zero status in the DP agreement: every replica stops.

    `replica` is the DP rank that sent the status, `status` its code.
    """

    def __init__(self, message: str, replica: int | None = None, status: int | None = None):
        super().__init__(message)
        self.replica = replica
        self.status = status


class ReplayInputError(RunnerError):
    """The run directory cannot be judged at all (missing, unreadable, no rank files)."""


# The reference model's errors

class UnsupportedModelError(ConfigError):
    """A model directory holds an architecture this reference model does not implement."""


class WeightsError(ConfigError):
    """A checkpoint lacks a tensor, holds an unexpected one, or one of the wrong shape."""


class DispatchCountError(DesyncError):
    """A rank's expert-exchange header disagrees with the DP agreement; raised on every rank.

    `replica` is the culprit's DP rank, `global_rank` its process, `reported` the dispatch
    count it should have sent to the agreement, `agreed` what the agreement holds for it,
    `rows` the rows it executes and `width` the exchange width every rank padded to.
    """

    def __init__(self, message: str, *, replica: int, global_rank: int, step_id: int,
                 reported: int, agreed: int, rows: int, width: int):
        super().__init__(message)
        self.replica = replica
        self.global_rank = global_rank
        self.step_id = step_id
        self.reported = reported
        self.agreed = agreed
        self.rows = rows
        self.width = width
