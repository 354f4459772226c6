"""Read and write the safetensors format without the `safetensors` package.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name
to its dtype, shape and byte range, then the raw little-endian bytes. Doing it here keeps the
reference model free of a dependency; files written here load with `safetensors` and back.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Mapping

import torch

from runner_fsm.errors import WeightsError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ALIGN = 8


def save_file(tensors: Mapping[str, torch.Tensor], path: str | Path,
              metadata: Mapping[str, str] | None = None) -> None:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs = []
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if tensor.dtype not in _NAMES:
            raise WeightsError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _ALIGN)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for blob in blobs:
            out.write(blob)


def load_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one file, as CPU tensors that own their memory."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        header, data_start = _read_header(mapped, path)
        return {name: _tensor(mapped, data_start, name, entry, path)
                for name, entry in header.items() if name != "__metadata__"}


def _read_header(mapped: mmap.mmap, path) -> tuple[dict, int]:
    if len(mapped) < 8:
        raise WeightsError(f"{path}: too short for a safetensors file ({len(mapped)} bytes)")
    (length,) = struct.unpack("<Q", mapped[:8])
    if 8 + length > len(mapped):
        raise WeightsError(f"{path}: header of {length} bytes runs past the end of the file")
    try:
        header = json.loads(mapped[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: unreadable safetensors header ({exc})") from None
    return header, 8 + length


def _tensor(mapped: mmap.mmap, data_start: int, name: str, entry: dict, path) -> torch.Tensor:
    dtype = _DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise WeightsError(f"{path}: {name} has unsupported dtype {entry.get('dtype')!r}")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    numel = 1
    for dim in shape:
        numel *= dim
    if end - begin != numel * dtype.itemsize or data_start + end > len(mapped):
        raise WeightsError(f"{path}: {name} claims shape {list(shape)} {entry['dtype']} but spans"
                           f" bytes {begin}..{end} of the data")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=data_start + begin)
    return flat.reshape(shape).clone()  # own the memory: the map closes on return
