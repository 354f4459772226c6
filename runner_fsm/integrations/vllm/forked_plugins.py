"""vLLM's general plugins loaded again in each process forked from one that loaded them.

vLLM loads its general plugins once per interpreter (`load_general_plugins`, guarded by the
module flag `vllm.plugins.plugins_loaded`) and calls it in each process it starts: the engine
core (`EngineCore.__init__`) and each worker (`WorkerBase.init_worker`). Under `spawn` each of
them is a fresh interpreter and loads the plugins itself. Under `fork`, vLLM's default start
method (an `LLM` script's engine core and workers on CUDA), the child inherits the flag set and
loads nothing: this package's plugins act per process (the engine core's stop registry, its
signal handlers and failure handler: `engine_stops`), so a forked engine core would tell its
workers of no stop and no failure. Seen on this CPU with vLLM's own start method (tests/README.md):
an engine-core failure then read as a clean stop.

`arm()` clears the flag in each child forked from here (`os.register_at_fork`; the hook is
inherited by the child's own forks), so vLLM's own calls in the child load the plugins as under
`spawn`, at the same place. vLLM asks every plugin to bear being loaded in several processes.

No public hook exists for this: the flag is vLLM's module global (read on 0.32.0 and 0.33.0;
`runner-fsm vllm-check` looks for it). Where the module has no such flag nothing is armed.
"""

from __future__ import annotations

import os
import sys

FLAG = "vllm.plugins.plugins_loaded"  # vLLM's "general plugins loaded in this interpreter"
_MODULE, _, _NAME = FLAG.rpartition(".")
_armed = False  # inherited by a fork, as the hook is: one hook per lineage


def arm() -> bool:
    """Clear vLLM's plugins-loaded flag in every process forked from this one from now on (False:
    this vLLM has no such flag; nothing done)."""
    global _armed
    if not _armed and _plugins() is not None:
        os.register_at_fork(after_in_child=_forget_loaded)
        _armed = True
    return _armed


def _plugins():
    """vLLM's plugins module, where it is imported and holds the flag (else None)."""
    plugins = sys.modules.get(_MODULE)
    return plugins if isinstance(getattr(plugins, _NAME, None), bool) else None


def _forget_loaded() -> None:
    plugins = _plugins()
    if plugins is not None:
        setattr(plugins, _NAME, False)
