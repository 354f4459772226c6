"""Requests of the embedded engine, their assignment to replicas, and greedy outputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from runner_fsm.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt to complete greedily; identical on every rank that knows it."""

    req_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0  # the engine step at which it becomes schedulable
    replica: int | None = None  # pinned by a trace; None: round-robin

    def __post_init__(self):
        if not self.prompt:
            raise ConfigError(f"request {self.req_id!r} has an empty prompt")
        if self.max_new_tokens < 1:
            raise ConfigError(f"request {self.req_id!r} needs max_new_tokens >= 1, got {self.max_new_tokens}")


def token_id_problem(req: Request, vocab_size: int | None) -> str | None:
    """Why `req`'s prompt cannot be embedded: an id outside [0, vocab_size) (None: fine). With
    no vocabulary known (a model factory), only negative ids are refused."""
    for position, token in enumerate(req.prompt):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
            return (f"request {req.req_id!r}: prompt token id {token} at position {position} is outside"
                    f" the vocabulary {bound}")
    return None


def assign(requests: Sequence[Request], dp_size: int) -> list[list[Request]]:
    """Per replica, its requests: trace-pinned ones where pinned, the rest round-robin."""
    per_replica: list[list[Request]] = [[] for _ in range(dp_size)]
    next_replica = 0
    for req in requests:
        if req.replica is not None:
            if not 0 <= req.replica < dp_size:
                raise ConfigError(f"request {req.req_id!r} is pinned to replica {req.replica},"
                                  f" but dp_size is {dp_size}")
            per_replica[req.replica].append(req)
        else:
            per_replica[next_replica].append(req)
            next_replica = (next_replica + 1) % dp_size
    return per_replica


def synthetic_requests(num: int, *, vocab_size: int, seed: int = 0, min_prompt: int = 4,
                       max_prompt: int = 48, max_new_tokens: int = 8,
                       arrival_every: int = 0) -> list[Request]:
    """Random prompts (a fixed seed makes them identical on every rank)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        length = int(rng.integers(min_prompt, max_prompt + 1))
        prompt = tuple(int(t) for t in rng.integers(1, vocab_size, length))
        out.append(Request(f"r{i}", prompt, max_new_tokens, arrival_step=i * arrival_every))
    return out


def load_trace(path: str | Path, *, dp_size: int = 1) -> list[Request]:
    """A JSON Lines trace, one request a line: {"id": str, "prompt_token_ids": [int],
    "max_new_tokens": int, "arrival_step": int, "replica": int (optional, modulo dp_size)}."""
    requests, seen = [], set()
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the trace {path}: {getattr(exc, 'strerror', None) or exc}") from None
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            replica = obj.get("replica")
            req = Request(str(obj["id"]), tuple(int(t) for t in obj["prompt_token_ids"]),
                          int(obj["max_new_tokens"]), int(obj.get("arrival_step", 0)),
                          None if replica is None else int(replica) % dp_size)
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise ConfigError(f"{path}:{line_no}: bad trace line: {exc}") from None
        if req.req_id in seen:
            raise ConfigError(f"{path}:{line_no}: request id {req.req_id!r} appears twice")
        seen.add(req.req_id)
        requests.append(req)
    if not requests:
        raise ConfigError(f"{path}: the trace holds no requests")
    return requests


def outputs_equal(a: dict[str, list[int]], b: dict[str, list[int]]) -> list[str]:
    """Request ids whose outputs differ (empty when equal)."""
    return sorted(rid for rid in set(a) | set(b) if a.get(rid) != b.get(rid))
