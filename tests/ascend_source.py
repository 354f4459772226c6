"""Reading vLLM-Ascend's classes from its source text, over vLLM's installed ones (for
tests/test_vllm_ascend_source.py; nothing of vLLM-Ascend is imported: `torch_npu` needs CANN).

A class is found by module and name: a `vllm_ascend` module's from the source text read (the
released sdist, or a git checkout), any other module's from the installed package (vLLM). Its
bases are followed through the module's imports (its globals, for an installed module). An
attribute is defined by a class when its body defines it (a method, a property, a class-level
name) or one of its methods assigns `self.<name>`; a dotted path is resolved one name at a time,
each further name on the class of the one before: the class its assignment constructs
(`self.x = Cls(...)`, also in a conditional expression) or annotates (`self.x: Cls = ...`), or
a property's return annotation or `return self.<other>`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from typing import Iterator

COLLECTIVES = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                         "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend",
                         "irecv", "all_to_all", "all_to_all_single"})


@dataclasses.dataclass(frozen=True)
class Class:
    """One class, read from its module's source: `tree` is that module's AST."""

    module: str
    name: str
    node: ast.ClassDef
    tree: ast.Module

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


class Sources:
    """`vllm_ascend` modules from `texts` ({path inside the package tree: text}); others installed."""

    def __init__(self, texts: dict[str, str], label: str):
        self.label = label
        self.texts = {path[:-3].replace("/", ".").removesuffix(".__init__"): text
                      for path, text in texts.items() if path.endswith(".py")}
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            if module.split(".")[0] == "vllm_ascend":
                assert module in self.texts, f"{module} is not in {self.label}"
                text = self.texts[module]
            else:
                text = inspect.getsource(importlib.import_module(module))
            self._trees[module] = ast.parse(text)
        return self._trees[module]

    def find(self, module: str, name: str) -> Class:
        tree = self.tree(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Class(module, name, node, tree)
        found = self._imported(module, name)
        assert found is not None, f"class {name} is neither defined nor imported in {module} ({self.label})"
        return self.find(*found)

    def _imported(self, module: str, dotted: str) -> tuple[str, str] | None:
        """(module, class name) a dotted name of `module` stands for, through its imports."""
        head, _, rest = dotted.partition(".")
        for node in self.tree(module).body:
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                for alias in node.names:
                    if (alias.asname or alias.name) == head:
                        if not rest:
                            return source, alias.name
                        return f"{source}.{alias.name}", rest  # `from pkg import mod` then mod.Cls
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if (alias.asname or alias.name) == head and rest:
                        return (alias.name if alias.asname else head), rest
        if module.split(".")[0] != "vllm_ascend":  # an installed module: its globals say it
            value = importlib.import_module(module)
            for part in dotted.split("."):
                value = getattr(value, part, None)
            if inspect.isclass(value):
                return value.__module__, value.__qualname__
        return None

    def lookup(self, cls: Class, expr: ast.expr | None) -> Class | None:
        """The class an expression names in `cls`'s module (a name, `mod.Cls`, `Cls[...]`)."""
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):  # a string annotation
            expr = ast.parse(expr.value, mode="eval").body
        if isinstance(expr, ast.BinOp):  # `Cls | None`
            return self.lookup(cls, expr.left) or self.lookup(cls, expr.right)
        if not isinstance(expr, (ast.Name, ast.Attribute)):
            return None
        dotted = ast.unparse(expr)
        if "." not in dotted and any(isinstance(n, ast.ClassDef) and n.name == dotted for n in cls.tree.body):
            return self.find(cls.module, dotted)
        found = self._imported(cls.module, dotted)
        return None if found is None else self.find(*found)

    # -- classes -------------------------------------------------------------------------

    def bases(self, cls: Class) -> list[Class]:
        return [base for expr in cls.node.bases if (base := self.lookup(cls, expr)) is not None]

    def mro(self, cls: Class) -> Iterator[Class]:
        """`cls`, then its bases depth first (enough for these single-inheritance classes)."""
        yield cls
        for base in self.bases(cls):
            yield from self.mro(base)

    def owner(self, cls: Class, attr: str) -> Class | None:
        """The first class of `cls`'s lineage that defines `attr` (see the module docstring)."""
        return next((c for c in self.mro(cls) if _defines(c.node, attr)), None)

    def type_of(self, cls: Class, attr: str) -> Class | None:
        """The class `attr` holds, by the most derived class that says."""
        for c in self.mro(cls):
            for value in _values(c.node, attr):
                if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
                    found = self.type_of(cls, value.attr)  # a property returning self.<other>
                else:
                    found = self.lookup(c, value)
                if found is not None:
                    return found
        return None

    def resolve(self, cls: Class, path: str) -> str | None:
        """None when every name of the dotted `path` resolves from `cls`, else what does not."""
        head, _, rest = path.partition(".")
        if self.owner(cls, head) is None:
            return f"{head} is defined by none of {', '.join(c.qualname for c in self.mro(cls))}"
        if not rest:
            return None
        held = self.type_of(cls, head)
        if held is None:
            return f"what {cls.qualname}.{head} holds cannot be read from its assignments"
        problem = self.resolve(held, rest)
        return None if problem is None else f"{head} ({held.qualname}): {problem}"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")[: -node.level]  # a module's own package is one level up
    return ".".join(package + ([node.module] if node.module else []))


def _functions(node: ast.ClassDef):
    return [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _self_targets(function) -> Iterator[tuple[ast.Attribute, ast.expr | None, ast.expr | None]]:
    """(target, value, annotation) of each `self.x = ...` / `self.x: T = ...` in a method."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    yield target, node.value, None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute) \
                and isinstance(node.target.value, ast.Name) and node.target.value.id == "self":
            yield node.target, node.value, node.annotation


def _defines(node: ast.ClassDef, attr: str) -> bool:
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == attr:
            return True
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
            return True
    return any(target.attr == attr for f in _functions(node) for target, _, _ in _self_targets(f))


def _values(node: ast.ClassDef, attr: str) -> Iterator[ast.expr]:
    """What says which class `attr` holds: annotations, constructors called, a property's return."""
    for f in _functions(node):
        if f.name == attr:  # a property: its return annotation, else what it returns
            if f.returns is not None:
                yield f.returns
            for ret in ast.walk(f):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    yield ret.value
        for target, value, annotation in _self_targets(f):
            if target.attr != attr:
                continue
            if annotation is not None:
                yield annotation
            for call in (value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,):
                if isinstance(call, ast.Call):
                    yield call.func


def collective_calls(tree: ast.Module) -> list[str]:
    """Every call of a collective by name (`x.all_gather(...)`, `broadcast(...)`), as source."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in COLLECTIVES:
                found.append(ast.unparse(node))
    return found


def methods(cls: Class) -> set[str]:
    return {f.name for f in _functions(cls.node)}
