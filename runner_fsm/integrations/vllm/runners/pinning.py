"""Pinning a change of vLLM behaviour to the vLLM it was written for: the source digest of a
vLLM function, compared against the one recorded when the change was tested (`runners/pcp/layout.py`,
`draft_dp_sync`). A function whose source differs may behave differently: the change is then
left out and the log's first record says why."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any


def source_digest(function: Any) -> str:
    """sha256 (first 16 hex) of `function`'s source, decorators included."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
