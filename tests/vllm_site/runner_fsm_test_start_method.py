"""Test set-up only (never imported by the package): vLLM's own start method for the processes it
starts, on its CPU platform, where the test run asks for it (`RUNNER_FSM_TEST_START_METHOD=vllm`).

vLLM starts its engine cores and workers with `multiprocessing`'s `fork` unless something asks
for `spawn` (`VLLM_WORKER_MULTIPROC_METHOD`): its CLI does (`vllm serve`, every platform), CUDA
does once CUDA is initialised in the parent, and vLLM's CPU platform does always: its
`check_and_update_config` sets `spawn` whatever the environment held (vllm/platforms/cpu.py,
0.32.0). On this CPU every worker of an offline TP/PP/PCP job, and every engine core an `LLM`
runs in a process of its own, is then a fresh interpreter that imports vLLM again: about 8 s of
CPU each on this machine, half of a TP=2 job's start (a TP=2 FSMWorker job, 3 requests: 22.3 s
of wall, 28.6 s of its children's CPU under `spawn`; 10.7 s and 11.7 s forked).

Under `RUNNER_FSM_TEST_START_METHOD=vllm` the CPU platform's hook runs as it is, and then the
method is put back to what it was before the hook: unset, vLLM's default (`fork`), for an `LLM`
script, as on CUDA; `spawn` for a served engine (vLLM's CLI set it first), as on every platform.
That holds for the first engine a process configures only. OpenMP's worker threads do not
survive a fork: a process that ran a model itself (an earlier `LLM` on vLLM's in-process
executor) and then forks workers leaves them waiting on threads that are not there (seen: the
MLA child's PCP=2 engine after its PCP=1 one, hung). vLLM makes the same call on CUDA, where it
falls back to `spawn` once CUDA is initialised in the parent; a process's later engines keep the
CPU platform's `spawn` here. A process that runs torch's parallel kernels before its first engine
must ask for `cpu` itself.

FSMWorker must be right under both; the tiers run the CUDA user's method, and the cases that
keep the CPU's `spawn` set `RUNNER_FSM_TEST_START_METHOD=cpu` in their children's environment
(tests/README.md). The variable is read at each call, not at import.

No public option reaches this: the CPU platform overwrites the variable unconditionally, and a
platform plugin of the tests' own could not stand beside the emulated device platform's (vLLM
takes one out-of-tree platform at most). So the method of the CPU platform's class is wrapped
when `vllm.platforms.cpu` is first imported, on vLLM 0.32.0 alone; on another version it is left
as it is (slower tiers, same outcomes), and tests/test_vllm_site.py fails to say so.
"""

import importlib.abc
import importlib.util
import os
import sys

MODE_ENV = "RUNNER_FSM_TEST_START_METHOD"  # "vllm": vLLM's own method; anything else: the CPU platform's
METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
VERSION = "0.32.0"  # the vLLM whose CPU platform was read for this
MODULE = "vllm.platforms.cpu"
_configured = False  # an engine was configured in this process before (inherited by a fork)


def _wrap(module) -> None:
    if getattr(sys.modules.get("vllm"), "__version__", None) != VERSION:
        return
    platform = module.CpuPlatform
    hook = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        global _configured
        before = os.environ.get(METHOD_ENV)
        first, _configured = not _configured, True
        hook(cls, vllm_config)
        if os.environ.get(MODE_ENV) != "vllm" or not first:
            return
        if before is None:
            os.environ.pop(METHOD_ENV, None)
        else:
            os.environ[METHOD_ENV] = before

    check_and_update_config.runner_fsm_test = True  # what tests/test_vllm_site.py looks for
    platform.check_and_update_config = classmethod(check_and_update_config)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the CPU platform's hook once its module has run; gone from `sys.meta_path` after."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if MODULE not in sys.modules:
    sys.meta_path.insert(0, _WrapOnImport())
