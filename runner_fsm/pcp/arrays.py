"""Integer array arguments: checked once, with a `BatchError` that names the argument."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from runner_fsm.errors import BatchError

ArrayLike = Sequence[int] | np.ndarray


def int_array(name: str, values: ArrayLike, ndim: int = 1, *, allow_bool: bool = False) -> np.ndarray:
    """`values` as an int64 array of `ndim` dimensions (bools too when `allow_bool`)."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == ndim:
        return values  # already what is asked for (the per-step case): no dtype probing
    arr = np.asarray(values)
    if arr.ndim != ndim:
        raise BatchError(f"{name} must be {ndim}-dimensional, got shape {arr.shape}")
    integral = np.issubdtype(arr.dtype, np.integer) or (allow_bool and np.issubdtype(arr.dtype, np.bool_))
    if arr.size and not integral:
        raise BatchError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)
