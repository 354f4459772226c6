"""Checks made once, in the launching process, before any rank starts: a user error found
here is one clear `ConfigError` instead of a traceback per rank, and no step runs for it."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from types import SimpleNamespace

from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import Request, assign, token_id_problem
from runner_fsm.engine.scheduler import RequestRefused, admission_error
from runner_fsm.errors import ConfigError


def prepare(cfg: EngineConfig, requests: list[Request]) -> EngineConfig:
    """`cfg` checked, with `max_model_len` taken from the model when not given; raises
    `ConfigError` (or `RequestRefused`) for a bad configuration, model or request."""
    cfg.validate()
    vocab_size = None
    if cfg.model_dir is not None:
        model = check_model_dir(cfg.model_dir)
        vocab_size = model.vocab_size
        if cfg.max_model_len is None:
            cfg = dataclasses.replace(cfg, max_model_len=model.max_position_embeddings)
    if cfg.draft_dir is not None and cfg.num_speculative_tokens > 0:
        check_model_dir(cfg.draft_dir)
    sched_cfg = cfg.scheduler_config()
    for replica, mine in enumerate(assign(requests, cfg.layout.dp_size)):
        for req in mine:
            refusal = token_id_problem(req, vocab_size) or admission_error(req, sched_cfg)
            if refusal is not None:
                raise RequestRefused(f"replica {replica}: {refusal}")
    return cfg


def check_model_dir(model_dir: str):
    """The model's config, after checking that every tensor it implies is in the shards'
    headers with its shape (headers only: no weights are read here)."""
    from runner_fsm.model_files.hf_config import MixtralConfig
    from runner_fsm.model_files.shapes import check_state_dict

    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    cfg = MixtralConfig.from_dir(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ConfigError(f"{model_dir}: no *.safetensors files")
    shapes: dict[str, SimpleNamespace] = {}
    for shard in shards:
        for name, entry in _header(shard).items():
            if name != "__metadata__":
                shapes[name] = SimpleNamespace(shape=tuple(entry.get("shape", ())))
    check_state_dict(cfg, shapes, str(path))
    return cfg


def _header(shard: Path) -> dict:
    """A safetensors file's JSON header: 8 bytes of little-endian length, then the JSON."""
    with shard.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError(f"{shard}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > shard.stat().st_size - 8:
            raise ConfigError(f"{shard}: header of {length} bytes runs past the end of the file")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{shard}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{shard}: the safetensors header is not a JSON object")
    return header
