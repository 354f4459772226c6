"""The static index `runner-fsm vllm-check` reads a vLLM source tree with (`common/source_index`),
on a small tree written here (no vLLM needed): it must see what an import would, and give the
source digest and signature exactly as the start-up checks compute them on the imported objects
(`common/pinning.source_digest`, `inspect.signature`)."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap

import pytest

from runner_fsm.integrations.vllm.common.source_index import SourceTree, parameters
from runner_fsm.integrations.vllm.common.source_signature import signature_text
from runner_fsm.integrations.vllm.common.pinning import source_digest

FILES = {
    "vllm/__init__.py": """
        MODULE_ATTRS = {"LLM": ".entry:LLM"}

        def __getattr__(name):
            if name in MODULE_ATTRS:
                raise AttributeError(name)
        """,
    "vllm/_version.py": "__version__ = version = '0.99.1'\n",
    "vllm/base.py": """
        import dataclasses
        import numpy as np

        @dataclasses.dataclass(frozen=True)
        class Segment:
            start: int
            stop: int

        class Base:
            shared: int = 0

            def __init__(self):
                self.from_base, (self.pair_a, self.pair_b) = 1, (2, 3)

            @property
            def prop(self):
                return 1
        """,
    "vllm/runner.py": """
        from collections.abc import Iterator

        import numpy as np

        from vllm.base import Base as Renamed, Segment

        if True:
            LATE = 1


        class Runner(Renamed):
            def load(self):
                self.model: int = 1
                self.count += 1

            @staticmethod
            # a comment between decorator and def
            def plan(rows: np.ndarray, segments: list[Segment], limit: int | None = None, *, fast=False) \\
                    -> Iterator[tuple[int, int]]:
                yield (1, 2)

            def _run_ar(self, a, /, b, *rest, c=3, **more):
                return a
        """,
}


@pytest.fixture()
def tree(tmp_path):
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return SourceTree(tmp_path)


def test_the_index_finds_what_an_import_would(tree):
    assert tree.version == "0.99.1"
    assert tree.resolve("vllm.runner").kind == "module"
    assert tree.resolve("vllm.runner.LATE").kind == "name"  # bound inside an `if`
    assert tree.resolve("vllm.LLM").kind == "lazy"  # served by the module's __getattr__
    assert tree.resolve("vllm.runner.Segment").qualname == "Segment"  # through the import
    assert tree.resolve("vllm.runner.np").kind == "external"
    runner = tree.resolve("vllm.runner.Runner")
    found = {name: tree.class_member(runner, name) for name in
             ("load", "model", "count", "from_base", "pair_b", "prop", "shared", "plan")}
    assert {name: f.qualname for name, f in found.items() if f} == {
        "load": "Runner.load", "model": "Runner.model", "count": "Runner.count", "from_base": "Base.from_base",
        "pair_b": "Base.pair_b", "prop": "Base.prop", "shared": "Base.shared", "plan": "Runner.plan"}
    for missing in ("vllm.runner.Runner.nothing", "vllm.nothing", "vllm.runner.nothing", "vllm.base.Base.model"):
        assert tree.resolve(missing) is None, missing
    assert tree.fields(tree.resolve("vllm.base.Segment")) == {"start", "stop"}


def test_digest_and_signature_are_what_the_start_up_checks_compute_on_the_import(tree, monkeypatch):
    monkeypatch.syspath_prepend(str(tree.root))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    imported = importlib.import_module("vllm.runner")
    try:
        for qualname in ("Runner.plan", "Runner._run_ar", "Runner.load", "Runner"):
            obj = imported
            for part in qualname.split("."):
                obj = inspect.getattr_static(obj, part) if obj is not imported else getattr(obj, part)
            obj = obj.__func__ if isinstance(obj, staticmethod) else obj
            found = tree.resolve(f"vllm.runner.{qualname}")
            assert tree.digest(found) == source_digest(obj), qualname
            if found.kind == "function":
                assert signature_text(tree, found) == str(inspect.signature(obj)), qualname
                assert parameters(found) == tuple(inspect.signature(obj).parameters), qualname
        segment = importlib.import_module("vllm.base").Segment
        assert tree.digest(tree.resolve("vllm.base.Segment")) == source_digest(segment)
    finally:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]


def test_a_directory_without_vllm_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a vLLM source tree"):
        SourceTree(tmp_path)
