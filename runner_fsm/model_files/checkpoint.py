"""A model directory's safetensors shards, read lazily: a rank reads only the tensors it keeps.

`safe_open` maps each shard and parses its header; `get_slice` gives every tensor's shape and
dtype without reading its bytes, so the whole checkpoint is checked against config.json
before anything is read. Indexing returns one tensor over the shard's mapping (safetensors
0.4+ with framework="pt": no copy; its pages are read when first touched); binding it to a
model of the same dtype on the CPU keeps that tensor, so a rank's peak memory is what it
keeps, not the checkpoint (`benchmarks/bench_load_rss.py` measures it). Another dtype or
device makes exactly one converted copy per kept tensor. Kept weights stay backed by the
file: it must not be rewritten in place while a model built from it runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from runner_fsm.errors import WeightsError


class LazyCheckpoint(Mapping):
    """name -> tensor over every `*.safetensors` shard of `model_dir`; `checkpoint[name]` reads."""

    def __init__(self, model_dir: str | Path):
        shards = sorted(Path(model_dir).glob("*.safetensors"))
        if not shards:
            raise WeightsError(f"{model_dir}: no *.safetensors files")
        self.source = str(model_dir)
        self._files = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._shard_of: dict[str, Path] = {}
        for shard in shards:
            handle = self._open(shard)
            for name in handle.keys():
                if name in self._shard_of:
                    raise WeightsError(f"{model_dir}: tensor {name} appears in more than one shard")
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())
                self._shard_of[name] = shard
            self._files[shard] = handle

    @staticmethod
    def _open(shard: Path):
        try:
            return safe_open(str(shard), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"{shard}: unreadable safetensors file ({exc})") from None

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from the header; reads no data."""
        return self._shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self._shard_of[name]  # KeyError for an unknown name, as a Mapping should
        try:
            return self._files[shard].get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"{shard}: cannot read {name} ({exc})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)
