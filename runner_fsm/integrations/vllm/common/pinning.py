"""Pinning a change of vLLM behaviour to the vLLM it was written for: the source digest of a
vLLM function, compared against the one recorded when the change was tested (`runners/pcp_layout.py`,
`runners/draft_dp_sync.py`). A function whose source differs may behave differently: the change is
then left out and the log's first record says why. `runner-fsm vllm-check` computes the same
digest from a source tree (`source_index.SourceTree.digest`): one formula, `text_digest`."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any


def text_digest(source: str) -> str:
    """sha256 (first 16 hex) of a source text."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def source_digest(function: Any) -> str:
    """`text_digest` of `function`'s source, decorators included."""
    return text_digest(inspect.getsource(function))
