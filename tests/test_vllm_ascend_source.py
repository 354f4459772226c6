"""The vLLM-Ascend runner adapter against vLLM-Ascend's own source (it cannot run here:
`torch_npu` breaks `import torch` without Ascend's CANN, so nothing of it is imported).

The source is the released sdist pinned in `runners.ascend.SOURCE_PIN`, fetched by pip into the
test's cache (no build: only its metadata is prepared, which wants `setuptools_scm` and an
Ascend SOC_VERSION); with `RUNNER_FSM_VLLM_ASCEND_GIT` naming a clone, the tree of commit
`runners.ascend.GIT_READ` instead (the PCP-for-DP work, newer than any release). Read with
`ast` over the installed vLLM (`ascend_source`), it must have every name the adapter and the
worker use:
- each method FSMWorker overrides, defined by `NPUWorker` itself or a base of its own (vLLM's
  `WorkerBase` only declares them: abstract stubs or no-ops), its dummy run through the
  runner's `_dummy_run`;
- the MRV2 runner subclassing vLLM's without overriding what the adapter wraps, and each dotted
  attribute path the adapter reads resolved name by name through the classes the runner's
  assignments construct (`input_buffers` is vLLM-Ascend's `AscendInputBuffers`);
- every name the PCP evidence reads (`pcp_evidence.MANAGER_NAMES`) on the PCP manager class the
  runner builds (`pcp_manager_cls`: `AscendPCPManager` at GIT_READ, vLLM's `PCPManager` in the
  release);
- no collective call at all (all_reduce, all_gather, broadcast, reduce_scatter, send, recv and
  their variants) in the runner's sources beside vLLM's one DP sync, which it keeps.
Mutations seen to fail it (each passed the check before): the adapter's `input_buffers.input_ids`
renamed `input_buffers.input_idz` (only the part before the dot was checked), the evidence's
buffer `positions` renamed `positionz` (the manager was not checked), `reset_mm_cache` added to
the overridden methods (`WorkerBase` declares it, `NPUWorker` does not define it).
"""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from ascend_source import Sources, collective_calls, methods

from runner_fsm.integrations.vllm import platform_worker
from runner_fsm.integrations.vllm.common import schema
from runner_fsm.integrations.vllm.runners import pcp_evidence
from runner_fsm.integrations.vllm.runners.ascend import GIT_READ, SOURCE_PIN, AscendMRV2Runner

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

WRAPPED = ("prepare_attn", "prepare_dummy_attn", "_dummy_run")  # must stay vLLM's own
GIT_ENV = "RUNNER_FSM_VLLM_ASCEND_GIT"


def _sdist_texts() -> tuple[dict[str, str], str]:
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
    with tarfile.open(found[0]) as tar:
        return _package_texts(tar, strip=1), SOURCE_PIN


def _git_texts(clone: str) -> tuple[dict[str, str], str]:
    archive = subprocess.run(["git", "-C", clone, "archive", GIT_READ, "vllm_ascend"], capture_output=True,
                             timeout=300, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return _package_texts(tar, strip=0), f"vllm-ascend at {GIT_READ[:12]}"


def _package_texts(tar: tarfile.TarFile, strip: int) -> dict[str, str]:
    """{path from `vllm_ascend/` on: text} of the package's Python files."""
    texts = {}
    for member in tar.getmembers():
        path = member.name.split("/", strip)[-1]
        if path.startswith("vllm_ascend/") and path.endswith(".py") and member.isfile():
            texts[path] = tar.extractfile(member).read().decode()
    return texts


@pytest.fixture(scope="module")
def ascend() -> Sources:
    clone = os.environ.get(GIT_ENV)
    return Sources(*(_git_texts(clone) if clone else _sdist_texts()))


def test_the_npu_worker_defines_what_fsm_worker_overrides(ascend):
    assert platform_worker.WORKERS["npu"][0] == "vllm_ascend.worker.worker.NPUWorker"
    worker = ascend.find("vllm_ascend.worker.worker", "NPUWorker")
    own = [c for c in ascend.mro(worker) if c.qualname != "vllm.v1.worker.worker_base.WorkerBase"]
    assert [c.qualname for c in ascend.bases(worker)] == ["vllm.v1.worker.worker_base.WorkerBase"]
    defined = set().union(*(methods(c) for c in own))
    missing = [m for m in schema.OVERRIDDEN if m not in defined]
    assert missing == [], f"NPUWorker ({ascend.label}) lacks {missing}: vLLM's WorkerBase only declares them"
    dummy = next(n for n in worker.node.body if isinstance(n, ast.FunctionDef) and n.name == "execute_dummy_batch")
    assert "self.model_runner._dummy_run(" in ast.unparse(dummy)  # the fault point the adapter wraps


def test_the_npu_mrv2_runner_resolves_every_path_the_adapter_reads(ascend):
    assert AscendMRV2Runner.CLASSES == ("vllm_ascend.worker.v2.model_runner.NPUModelRunner",)
    runner = ascend.find("vllm_ascend.worker.v2.model_runner", "NPUModelRunner")
    assert [c.qualname for c in ascend.bases(runner)] == ["vllm.v1.worker.gpu.model_runner.GPUModelRunner"]
    overridden = methods(runner) & set(WRAPPED)
    assert not overridden, f"NPUModelRunner overrides {sorted(overridden)}: re-read the adapter"
    problems = {path: ascend.resolve(runner, path) for path in AscendMRV2Runner.ATTRS + AscendMRV2Runner.KV_ATTRS}
    assert {path: p for path, p in problems.items() if p} == {}, ascend.label
    held = ascend.type_of(runner, "input_buffers")
    assert held is not None and held.name == "AscendInputBuffers"  # vLLM-Ascend's own, re-made in __init__


def test_the_pcp_manager_the_runner_builds_has_every_name_the_evidence_reads(ascend):
    runner = ascend.find("vllm_ascend.worker.v2.model_runner", "NPUModelRunner")
    owner = ascend.owner(runner, "pcp_manager_cls")
    assert owner is not None, "no pcp_manager_cls on the runner: which PCP manager it builds is unknown"
    manager = ascend.type_of(owner, "pcp_manager_cls")  # the class the property returns
    assert manager is not None
    if ascend.label.startswith("vllm-ascend at"):  # the git head read: vLLM-Ascend's own manager
        assert manager.qualname == "vllm_ascend.worker.v2.pcp_manager.AscendPCPManager"
    problems = {name: ascend.resolve(manager, name) for name in pcp_evidence.MANAGER_NAMES}
    assert {name: p for name, p in problems.items() if p} == {}, (manager.qualname, ascend.label)


def test_the_evidence_reads_nothing_of_the_manager_beyond_its_names():
    """MANAGER_NAMES is what the test above checks, so it must be every name `runners/pcp/evidence.py`
    reads from the manager (`self.manager.x`, `manager.x`)."""
    tree = ast.parse(Path(pcp_evidence.__file__).read_text())
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner = node.value
            if isinstance(inner, ast.Attribute) and inner.attr == "manager" or \
                    isinstance(inner, ast.Name) and inner.id == "manager":
                read.add(node.attr)
    heads = {name.split(".")[0] for name in pcp_evidence.MANAGER_NAMES}
    assert read and read <= heads, sorted(read - heads)


def test_no_collective_beside_vllms_one_dp_sync(ascend):
    v2 = [module for module in ascend.texts if module.startswith("vllm_ascend.worker.v2.")]
    assert v2, f"no worker/v2 sources in {ascend.label}"
    calls = {module: collective_calls(ascend.tree(module)) for module in v2}
    assert {module: found for module, found in calls.items() if found} == {}
    remade = [module for module in v2 for node in ast.walk(ascend.tree(module))
              if isinstance(node, ast.FunctionDef) and node.name == "dispatch_cg_and_sync_dp"]
    assert remade == []  # vLLM's own sync, not a copy of its own
