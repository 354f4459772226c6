"""The vLLM integration's rooms (docs/architecture.md): runner names only in `runners/`, every name
an adapter reads in its tables, and no module importing a room above its own.

An AST walk, not a grep of strings: an attribute read on a model runner or one of its parts (the
runner, its drafter or speculator, its PCP manager, vLLM's runner-private `dp_utils`) is found
by the expression it is read from. Needs no vLLM (the modules are parsed, the tables imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "runner_fsm" / "integrations" / "vllm"
PREFIX = "runner_fsm.integrations.vllm"
# Expressions that are a model runner or one of its parts, by the name they are read through.
RUNNER_PARTS = {"runner", "model_runner", "drafter", "speculator", "pcp_manager", "manager", "dp_utils"}
# Where vLLM keeps a runner's private parts: imported only by the adapters.
RUNNER_MODULES = ("vllm.v1.worker.dp_utils", "vllm.v1.worker.gpu.dp_utils", "vllm.v1.worker.gpu_model_runner",
                  "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.pcp_manager", "vllm.v1.spec_decode",
                  "vllm.v1.worker.gpu.spec_decode")
# Rooms from the bottom up: a module imports its own room and the rooms below it, never above.
# `runners` and `cpu` sit side by side (neither imports the other), as do `dp` and `recording`.
LAYERS = {"common": 0, "base": 0, "runners": 1, "cpu": 1, "emulation": 1, "dp": 2, "recording": 2, "top": 3}
BASE = {"options"}  # beside common/: the worker's options


def _modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(under.rglob("*.py"))


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    if len(parts) > 1:
        return parts[0]
    return "base" if path.stem in BASE else "top"


def _part(node: ast.AST) -> str | None:
    """The runner part an expression names: `runner`, `self.runner`, `adapter.runner`, ..."""
    if isinstance(node, ast.Name):
        return node.id if node.id in RUNNER_PARTS else None
    if isinstance(node, ast.Attribute):
        return node.attr if node.attr in RUNNER_PARTS else None
    return None


def runner_reads(path: Path) -> list[tuple[int, str, str]]:
    """(line, part, name) for every attribute read on a runner part in `path`: `part.name`,
    `getattr(part, "name")`/`hasattr`/`setattr`, and the wraps of `runners/base.py`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _part(node.value):
            if not (node.attr.startswith("__") and node.attr.endswith("__")):
                found.append((node.lineno, _part(node.value), node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 \
                and node.func.id in ("getattr", "hasattr", "setattr", "wrap_method", "unwrap_method", "_wrap") \
                and _part(node.args[0]) and isinstance(node.args[1], ast.Constant):
            found.append((node.lineno, _part(node.args[0]), node.args[1].value))
    return found


def runner_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each import of a runner-private vLLM module (`from vllm.v1.worker
    import dp_utils` included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith(RUNNER_MODULES)]
    return found


# `emulation/` stands in for the device (vLLM's platform side), not for the worker: it calls vLLM's
# runner and graph manager as vLLM's CUDA worker does, checks those names itself when it installs
# (`emulation.graphs.check`), and the worker never imports it.
OUTSIDE = [p for p in _modules() if not {"runners", "emulation"} & set(p.relative_to(PACKAGE).parts)]
INSIDE = _modules(PACKAGE / "runners")


@pytest.mark.parametrize("path", OUTSIDE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_runner_attribute_is_read_outside_the_adapters(path):
    reads = [f"line {line}: {part}.{name}" for line, part, name in runner_reads(path)]
    reads += [f"line {line}: import {name}" for line, name in runner_imports(path)]
    assert reads == [], f"{path.relative_to(PACKAGE)} reads a model runner's names; ask its adapter (runners/)"


def adapter_tables() -> set[str]:
    """Every name the adapters' tables list: ATTRS and KV_ATTRS (each part of a path), READS,
    the PCP manager's names, and the DP hooks' vLLM names."""
    from runner_fsm.integrations.vllm.runners import ADAPTERS
    from runner_fsm.integrations.vllm.runners.hooks import DP_HOOKS
    from runner_fsm.integrations.vllm.runners import pcp_evidence as evidence
    from runner_fsm.integrations.vllm.runners import pcp_layout as layout

    names: set[str] = set()
    for adapter in ADAPTERS:
        for path in adapter.ATTRS + adapter.KV_ATTRS:
            names.update(part.partition("[")[0] for part in path.split("."))
        for listed in adapter.READS.values():
            names.update(listed)
    for path in (*evidence.manager_names("0.32.0"), *evidence.manager_names("0.33.0"), *layout.MANAGER_NAMES):
        names.update(path.split("."))
    for by_release in DP_HOOKS.values():
        for hooks in by_release.values():
            for listed in (*hooks.names.values(), *hooks.methods.values()):
                names.update(listed)
    return names


def test_every_name_an_adapter_reads_is_in_its_tables():
    listed = adapter_tables()
    unlisted = [f"{path.relative_to(PACKAGE)}:{line}: {part}.{name}" for path in INSIDE
                for line, part, name in runner_reads(path) if name not in listed]
    assert unlisted == []


def test_the_walk_finds_what_a_module_outside_runners_would_read(tmp_path):
    """The walk itself: each form of read is found (else the tests above pass on nothing)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(worker, adapter, runner):\n"
                     "    a = worker.model_runner.input_batch\n"
                     "    b = adapter.runner.model\n"
                     "    c = getattr(runner, 'drafter', None)\n"
                     "    wrap_method(runner.speculator, 'propose', None)\n"
                     "    from vllm.v1.worker import dp_utils\n"
                     "    return dp_utils._run_ar\n")
    assert {(part, name) for _line, part, name in runner_reads(probe)} == {
        ("model_runner", "input_batch"), ("runner", "model"), ("runner", "drafter"), ("runner", "speculator"),
        ("speculator", "propose"), ("dp_utils", "_run_ar")}
    assert [name for _line, name in runner_imports(probe)] == ["vllm.v1.worker.dp_utils"]


def _imported_rooms(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, its room) for each import of this package's modules in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            rest = node.module[len(PREFIX):].lstrip(".").split(".") if node.module != PREFIX else []
            targets = [rest + [a.name] for a in node.names] if not rest else [rest]
            for parts in targets:
                room = parts[0] if parts and (PACKAGE / parts[0]).is_dir() else \
                    ("base" if parts and parts[0] in BASE else "top")
                found.append((node.lineno, ".".join(parts), room))
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_room_above_its_own(path):
    own = _room(path)
    wrong = [f"line {line}: {module} ({room})" for line, module, room in _imported_rooms(path)
             if room != own and LAYERS[room] >= LAYERS[own] and not (own == "top" and room == "top")]
    assert wrong == [], f"{path.relative_to(PACKAGE)} ({own}) imports a room at or above its own"


class _Manager:
    """A PCP manager with every name the evidence reads; `input_buffers` asserts, as vLLM's
    property does until its buffers exist."""

    def __init__(self, drop: str | None = None):
        for name in ("pcp_world_size", "shard_decode_requests", "_hidden_restore_idx", "_gathered_kv_slot_mappings"):
            if name != drop:
                setattr(self, name, None)

    def get_num_tokens_for_dispatch(self):
        pass

    def prepare_inputs_to_capture(self):
        pass

    def get_dummy_slot_mappings(self):
        pass

    @property
    def input_buffers(self):
        raise AssertionError("no buffers yet")


@pytest.mark.parametrize("drop", [None, "_gathered_kv_slot_mappings", "pcp_world_size"])
def test_the_pcp_managers_names_are_checked_once_the_kv_cache_exists(drop):
    from types import SimpleNamespace

    from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner

    tables = SimpleNamespace(input_block_tables=[0], slot_mappings=[0])
    graphs = SimpleNamespace(capture=None, run_fullgraph=None, graphs={}, dispatch=None)  # the graph manager's calls
    adapter = MRV2Runner(SimpleNamespace(block_tables=tables, cudagraph_manager=graphs, pcp_manager=_Manager(drop)))
    expected = [] if drop is None else [f"_Manager.{drop} is missing (mrv2 runner's PCP manager)"]
    assert adapter.problems(kv_cache=True) == expected
    assert MRV2Runner(SimpleNamespace(block_tables=tables, cudagraph_manager=graphs,
                                      pcp_manager=None)).problems(kv_cache=True) == []
