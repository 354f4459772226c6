"""The package's shape, read from its imports (every import statement, those under
`TYPE_CHECKING` and inside functions included): no import cycle between modules, no cycle
between rooms (the package's folders), no folder of more than 15 modules, and a package root of
at most 8 modules besides `__init__`. docs/architecture.md draws the rooms and their floors."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "runner_fsm"
MAX_MODULES = 15
MAX_ROOT_MODULES = 8


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package (a package's `__init__` as the package)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, wherever the import statement stands."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` names a.b.c's package too
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `edges`, as the nodes along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def room(module: str, path: Path) -> str:
    """A module's room: its folder (a package's `__init__` belongs to its own folder)."""
    return str(path.parent.relative_to(PACKAGE.parent))


def test_no_module_imports_itself_back():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_rooms_form_floors():
    """Rooms (folders below the package root; a sub-folder is a room of its own) import each
    other one way only: no arrow from a lower room back up. The root's own modules (the CLI, errors, config, the DP agreement's
    contract module) are the hall every room may use and are left out."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        mine = room(name, known[name])
        if mine == "runner_fsm":
            continue
        for target in targets:
            theirs = room(target, known[target])
            if theirs not in ("runner_fsm", mine):
                edges.setdefault(mine, set()).add(theirs)
    found = cycle(edges)
    assert found is None, "rooms in a cycle: " + " -> ".join(found)


def test_no_room_is_crowded():
    counts: dict[Path, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {str(folder.relative_to(PACKAGE.parent)): n for folder, n in counts.items() if n > MAX_MODULES}
    assert not crowded, crowded
    assert counts[PACKAGE] <= MAX_ROOT_MODULES, sorted(p.name for p in PACKAGE.glob("*.py"))


def test_the_cycle_finder_finds_a_cycle():
    """The control: the finder above is not blind."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
