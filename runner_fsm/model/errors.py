"""Errors of the reference model; they extend the runner's one hierarchy."""

from __future__ import annotations

from runner_fsm.errors import ConfigError, DesyncError


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
