"""A vLLM source tree read without importing it: what `runner-fsm vllm-check` checks names against.

The worker's start-up checks ask the imported vLLM; a source tree of another release (a CUDA
wheel, unpacked) cannot be imported here, so this reads the same facts from its `.py` files with
`ast`: whether a module exists, its module-level names (defs, classes, assignments, imports,
and the names a lazy module `__getattr__` serves), a class's members (methods, properties, class
attributes, annotated fields, and every `self.X = ...` in its methods), inherited ones through
bases resolved across modules, a function's parameters and source, and the source digest exactly
as `common/pinning.source_digest` computes it on the imported function (`inspect.getsource` is
`inspect.getblock` over the file's lines from the first decorator line).

What an import would do and this cannot: run code (a name made by `setattr` or `globals()` at
import time is not seen), or read into a class of another package (`torch.nn.Module`): a path
that leaves the tree is taken as found (`Found.kind == "external"`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from functools import cached_property, lru_cache
from pathlib import Path

from runner_fsm.integrations.vllm.common.pinning import text_digest

_VERSION = re.compile(r"""^__version__\s*(?:=\s*version\s*)?=\s*['"]([^'"]+)['"]""", re.M)


@dataclasses.dataclass(frozen=True)
class Found:
    """What a dotted path names: kind is module, class, function, name (an assignment or
    annotation), lazy (served by a module `__getattr__`) or external (outside the tree)."""

    kind: str
    module: "ModuleIndex | None"
    node: ast.AST | None = None
    qualname: str = ""


class ModuleIndex:
    """One module's file, parsed once."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.text = path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.text, str(path))

    @cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines(keepends=True)

    @cached_property
    def names(self) -> dict[str, ast.AST]:
        """Module-level name -> the node that binds it (an import binds its alias)."""
        return _bindings(self.tree.body)

    @cached_property
    def imports(self) -> dict[str, str]:
        """Module-level name -> the dotted path it was imported from."""
        out: dict[str, str] = {}
        for node in _statements(self.tree.body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(self, node)
                for alias in node.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = f"{base}.{alias.name}"
        return out

    @cached_property
    def lazy_names(self) -> set[str]:
        """Names a module-level `__getattr__` may serve: every string constant of the module."""
        if "__getattr__" not in self.names:
            return set()
        return {n.value for n in ast.walk(self.tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    @cached_property
    def future_annotations(self) -> bool:
        return any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                   and any(a.name == "annotations" for a in n.names) for n in self.tree.body)


def _statements(body: list[ast.stmt]):
    """The statements of a body, into `if`/`try`/`with` blocks (not into defs or classes)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _statements(getattr(node, block, []) or [])
            for handler in getattr(node, "handlers", []):
                yield from _statements(handler.body)


def _targets(target: ast.AST):
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _targets(element)
    else:
        yield target


def _bindings(body: list[ast.stmt]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in _statements(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in _targets(target):
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    out.setdefault(alias.asname or alias.name.split(".")[0], node)
    return out


def _absolute(module: ModuleIndex, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.name.split(".")
    base = parts if module.path.name == "__init__.py" else parts[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """Every `self.X` a method of `cls` assigns (`self.X = ...`, `self.X: T = ...`, `self.X += ...`)."""
    found = set()
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For)) else \
                [item.optional_vars for item in node.items if item.optional_vars] if isinstance(node, ast.With) else []
            for target in targets:
                for t in _targets(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        found.add(t.attr)
    return found


class SourceTree:
    """A directory holding `vllm/` (an unpacked wheel or sdist, or site-packages)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"{self.root} holds no vllm/__init__.py: not a vLLM source tree")

    @cached_property
    def version(self) -> str:
        """The tree's vLLM version, from `vllm/_version.py` (or `vllm/version.py`)."""
        for name in ("_version.py", "version.py"):
            path = self.root / "vllm" / name
            if path.is_file():
                match = _VERSION.search(path.read_text(encoding="utf-8"))
                if match:
                    return match.group(1)
        return "unknown"

    @lru_cache(maxsize=None)
    def module(self, name: str) -> ModuleIndex | None:
        """The module `name` (a dotted path), or None where the tree has no such file."""
        base = self.root.joinpath(*name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return ModuleIndex(name, path)
        return None

    def resolve(self, dotted: str, _depth: int = 0) -> Found | None:
        """What `dotted` names in the tree, following imports and bases; None where it is missing."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = self.module(".".join(parts[:cut]))
            if module is not None:
                found: Found | None = Found("module", module, module.tree, "")
                for part in parts[cut:]:
                    found = self.member(found, part, _depth)
                    if found is None or found.kind == "external":
                        return found
                return found
        return Found("external", None) if parts[0] != "vllm" else None

    def member(self, found: Found, name: str, _depth: int = 0) -> Found | None:
        """`name` on what `found` names: a module's name or submodule, a class's member."""
        if found.kind == "module":
            module = found.module
            if name in module.imports and _depth < 12:
                target = module.imports[name]
                return self.resolve(target, _depth + 1) if target.startswith("vllm") else Found("external", None)
            node = module.names.get(name)
            if node is not None:
                return _found(module, node, name)
            sub = self.module(f"{module.name}.{name}")
            if sub is not None:
                return Found("module", sub, sub.tree, "")
            return Found("lazy", module, None, name) if name in module.lazy_names else None
        if found.kind == "class":
            return self.class_member(found, name)
        return None

    def mro(self, cls: Found, _depth: int = 0) -> list[Found]:
        """`cls` and its bases found in the tree, depth first (bases outside it are left out)."""
        out = [cls]
        for base in cls.node.bases:
            while isinstance(base, ast.Subscript):  # Generic[T], Base[T]
                base = base.value
            dotted = _dotted(base)
            if dotted is None or _depth > 20:
                continue
            head, _, rest = dotted.partition(".")
            start = self.member(Found("module", cls.module, cls.module.tree), head)
            for part in rest.split(".") if rest else []:
                start = None if start is None else self.member(start, part)
            if start is not None and start.kind == "class":
                out += [c for c in self.mro(start, _depth + 1) if c not in out]
        return out

    def class_member(self, cls: Found, name: str) -> Found | None:
        for klass in self.mro(cls):
            node = _class_body(klass.node).get(name)
            if node is not None:
                return _found(klass.module, node, f"{klass.qualname}.{name}")
            if name in self_attributes(klass.node):
                return Found("name", klass.module, None, f"{klass.qualname}.{name}")
        return None

    def fields(self, cls: Found) -> set[str]:
        """The annotated fields of `cls` and its bases (a dataclass's, a NamedTuple's)."""
        return {n.target.id for klass in self.mro(cls) for n in klass.node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    def source(self, found: Found) -> str:
        """A def's or class's source as `inspect.getsource` gives it on the imported object."""
        node = found.node
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "".join(inspect.getblock(found.module.lines[start - 1:]))

    def digest(self, found: Found) -> str:
        """As `pinning.source_digest` gives it on the imported object."""
        return text_digest(self.source(found))


def _class_body(node: ast.ClassDef) -> dict[str, ast.AST]:
    return _bindings(node.body)


def _found(module: ModuleIndex, node: ast.AST, qualname: str) -> Found:
    kind = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}.get(type(node))
    if kind is None and isinstance(node, (ast.Import, ast.ImportFrom)):
        kind = "external"
    return Found(kind or "name", module, node, qualname)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def parameters(found: Found) -> tuple[str, ...]:
    """A function's parameter names, as `inspect.signature(...).parameters` lists them."""
    args = found.node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    names += [args.vararg.arg] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    names += [args.kwarg.arg] if args.kwarg else []
    return tuple(names)
