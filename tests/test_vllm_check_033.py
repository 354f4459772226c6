"""The vLLM 0.33 stand-ins (tests/vllm033_standin) give only names vLLM 0.33.0's released source
has, with its parameters: every module-level function and class of each stand-in module, and
every method of those classes, is found at the same path in 0.33.0's source (read with the
same static index as `runner-fsm vllm-check`), and each function takes the parameters 0.33.0's
does. A stand-in that drifts from the release it stands for fails here, not in a user's run.
Needs the released source (downloaded once, as tests/test_vllm_check.py does): `vllm` tier."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from runner_fsm.integrations.vllm.common.source_index import SourceTree, parameters
from test_vllm_check import released_source

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

STANDIN = Path(__file__).resolve().parent / "vllm033_standin"


def _standin_names(root: Path = STANDIN) -> list[tuple[str, str, tuple[str, ...] | None]]:
    """(module, qualname, parameters or None for a class) of every def and class the stand-ins give."""
    out = []
    for path in sorted((root / "vllm").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                out.append((module, node.name, tuple(a.arg for a in (*node.args.args, *node.args.kwonlyargs))))
            elif isinstance(node, ast.ClassDef):
                out.append((module, node.name, None))
                out += [(module, f"{node.name}.{item.name}",
                         tuple(a.arg for a in (*item.args.args, *item.args.kwonlyargs)))
                        for item in node.body if isinstance(item, ast.FunctionDef) and item.name != "__init__"]
    return out


def _problems(tree: SourceTree, names) -> list[str]:
    problems = []
    for module, qualname, params in names:
        found = tree.resolve(f"{module}.{qualname}")
        if found is None or found.kind not in ("function", "class"):
            problems.append(f"{module}.{qualname} is not in vLLM {tree.version}")
        elif params is not None and parameters(found) != params:
            problems.append(f"{module}.{qualname}{params}: {tree.version} has {parameters(found)}")
    return problems


def test_every_standin_name_is_033s_with_its_parameters():
    tree = SourceTree(released_source("0.33.0"))
    assert tree.version == "0.33.0"
    names = _standin_names()
    assert len(names) >= 10, names  # the walk found the stand-ins
    assert _problems(tree, names) == []


def test_a_standin_that_drifted_is_named(tmp_path):
    """The test above can fail: a parameter renamed, and a function 0.33 does not have, in a copy."""
    import shutil

    copy = tmp_path / "standin"
    shutil.copytree(STANDIN, copy)
    path = copy / "vllm" / "distributed" / "parallel_state.py"
    path.write_text(path.read_text().replace("def cpu_all_reduce_(self, tensor", "def cpu_all_reduce_(self, t")
                    + "\n\ndef get_dp_group_v2():\n    return None\n")
    assert _problems(SourceTree(released_source("0.33.0")), _standin_names(copy)) == [
        "vllm.distributed.parallel_state.GroupCoordinator.cpu_all_reduce_('self', 't'): 0.33.0 has ('self', 'tensor')",
        "vllm.distributed.parallel_state.get_dp_group_v2 is not in vLLM 0.33.0"]
