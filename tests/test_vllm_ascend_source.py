"""The vLLM-Ascend runner adapter against vLLM-Ascend's own source (it cannot run here:
`torch_npu` breaks `import torch` without Ascend's CANN, so nothing of it is imported).

The source is the released sdist pinned in `runners.ascend.SOURCE_PIN`, fetched by pip into the
test's cache (no build: only its metadata is prepared, which wants `setuptools_scm` and an
Ascend SOC_VERSION). Read with `ast`, it must have every name the adapter and the worker use:
the NPU worker's methods that FSMWorker overrides and its dummy run through the runner's
`_dummy_run`; the MRV2 runner subclassing vLLM's MRV2 runner without overriding what the
adapter wraps; each attribute the adapter reads, on the NPU runner or on the installed vLLM's
MRV2 runner; and no DP collective of its own beside vLLM's one sync.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from runner_fsm.integrations.vllm import platform_worker, schema
from runner_fsm.integrations.vllm.runners.ascend import SOURCE_PIN, AscendMRV2Runner

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

WRAPPED = ("prepare_attn", "prepare_dummy_attn", "_dummy_run")  # must stay vLLM's own


@pytest.fixture(scope="module")
def ascend_source(tmp_path_factory) -> dict[str, str]:
    """{path inside the package: text} of vllm_ascend/worker/*.py and worker/v2/*.py."""
    cache = Path(os.environ.get("RUNNER_FSM_CACHE", Path.home() / ".cache" / "runner-fsm")) / "vllm-ascend"
    cache.mkdir(parents=True, exist_ok=True)
    name = SOURCE_PIN.replace("==", "-").replace("-", "_", 1)
    found = sorted(cache.glob(f"{name}.tar.gz"))
    if not found:
        env = dict(os.environ, SOC_VERSION=os.environ.get("SOC_VERSION", "ascend910b1"))
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
                              "--no-build-isolation", "-q", "-d", str(cache), SOURCE_PIN],
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"pip could not fetch {SOURCE_PIN}: {out.stderr[-2000:]}"
        found = sorted(cache.glob(f"{name}.tar.gz"))
    assert found, f"no sdist of {SOURCE_PIN} in {cache}"
    texts = {}
    with tarfile.open(found[0]) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) == 2 and parts[1].startswith("vllm_ascend/worker/") and parts[1].endswith(".py"):
                texts[parts[1]] = tar.extractfile(member).read().decode()
    return texts


def _class(source: str, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} is missing"
    return found[0]


def _defined(cls: ast.ClassDef) -> set[str]:
    """Methods and `self.x = ...` attributes a class body defines."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                  and t.value.id == "self"}
    return names


def test_the_npu_worker_has_what_fsm_worker_overrides(ascend_source):
    assert platform_worker.WORKERS["npu"][0] == "vllm_ascend.worker.worker.NPUWorker"
    worker = _class(ascend_source["vllm_ascend/worker/worker.py"], "NPUWorker")
    from vllm.v1.worker.worker_base import WorkerBase

    assert [ast.unparse(b) for b in worker.bases] == ["WorkerBase"]
    missing = [m for m in schema.OVERRIDDEN if m not in _defined(worker) and not hasattr(WorkerBase, m)]
    assert missing == [], f"NPUWorker lacks {missing}"
    dummy = next(n for n in worker.body if isinstance(n, ast.FunctionDef) and n.name == "execute_dummy_batch")
    assert "self.model_runner._dummy_run(" in ast.unparse(dummy)  # the fault point the adapter wraps


def test_the_npu_mrv2_runner_is_vllms_mrv2_runner_where_the_adapter_reads_it(ascend_source):
    source = ascend_source["vllm_ascend/worker/v2/model_runner.py"]
    runner = _class(source, "NPUModelRunner")
    assert "from vllm.v1.worker.gpu.model_runner import GPUModelRunner" in source
    assert [ast.unparse(b) for b in runner.bases] == ["GPUModelRunner"]
    assert AscendMRV2Runner.CLASSES == ("vllm_ascend.worker.v2.model_runner.NPUModelRunner",)
    own = _defined(runner)
    assert not own & set(WRAPPED), f"NPUModelRunner overrides {sorted(own & set(WRAPPED))}: re-read the adapter"
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    vllm_source = inspect.getsource(GPUModelRunner)
    vllm_own = _defined(_class(vllm_source, "GPUModelRunner"))
    for path in AscendMRV2Runner.ATTRS + AscendMRV2Runner.KV_ATTRS:
        head = path.split(".")[0]
        assert head in own or head in vllm_own or hasattr(GPUModelRunner, head), f"{head} is on neither runner"
    assert "self.input_buffers" in ast.unparse(runner)  # re-made (AscendInputBuffers): still named so


def test_no_dp_collective_beside_vllms_sync(ascend_source):
    v2 = {path: text for path, text in ascend_source.items() if path.startswith("vllm_ascend/worker/v2/")}
    assert v2, "no worker/v2 sources in the sdist"
    assert [path for path, text in v2.items() if "all_reduce(" in text] == []
    assert not any("dispatch_cg_and_sync_dp" in text and "def dispatch_cg_and_sync_dp" in text for text in v2.values())
