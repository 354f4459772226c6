"""`runner-fsm vllm-check`: every vLLM name the worker relies on, checked against a vLLM source
tree before it is installed (docs/vllm.md, "Before upgrading vLLM").

It reads the tables the start-up checks read on the imported vLLM (one table, two users), each
picked for the tree's release (`common/versions`): the schema's, the platform workers, each
runner adapter's CLASSES, ATTRS, KV_ATTRS, READS and DP hooks, the PCP manager's names and pins,
the draft DP sync's pins, `serve`'s CLI_ENV_SETUP, `stop_origin`'s shutdown words, `forked_plugins`'
flag, the emulation's names, the CPU collectives, and every `from vllm... import` of this package;
from the tree's source (`common/source_index`), never importing it.

Only the start-up checks see an attribute path of ATTRS/KV_ATTRS beyond its first name (that one
is looked for on the runner class: a `self.X` assignment, a method or a property, inherited ones
included), names read on the drafter, and anything vLLM makes at run time.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterable

from runner_fsm.integrations.vllm.common import versions
from runner_fsm.integrations.vllm.common.source_index import Found, SourceTree, parameters
from runner_fsm.integrations.vllm.common.source_signature import signature_text

PACKAGE = Path(__file__).resolve().parent
GROUPS = ("common", "worker", "v1", "mrv2", "ascend-mrv2", "emulation")
# Which group checks the imports of a module of this package (by its path below PACKAGE).
_IMPORT_GROUPS = (("runners/v1", "v1"), ("runners/ascend", "ascend-mrv2"), ("runners/", "mrv2"),
                  ("emulation/", "emulation"))


@dataclasses.dataclass(frozen=True)
class Check:
    """One vLLM name: its group, what it is and who expects it, and what moved (None: it holds)."""

    group: str
    name: str
    by: str
    moved: str | None = None


class Checker:
    """The checks of one tree, collected by group."""

    def __init__(self, tree: SourceTree):
        self.tree = tree
        self.checks: list[Check] = []
        self.notes: dict[str, list[str]] = {}
        self.tables = versions.nearest(tree.version)  # the release whose tables were read
        self.unknown = not versions.known(tree.version)  # not a release this package was checked against

    def add(self, group: str, name: str, by: str, moved: str | None = None) -> None:
        self.checks.append(Check(group, name, by, moved))

    def name(self, group: str, path: str, by: str) -> Found | None:
        """`path` must name something; returns what it names."""
        found = self.tree.resolve(path)
        self.add(group, path, by, None if found is not None else f"{path} is missing (expected by {by})")
        return found

    def members(self, group: str, cls_path: str, names: Iterable[str], by: str) -> None:
        cls = self.tree.resolve(cls_path)
        if cls is None or cls.kind != "class":
            self.add(group, cls_path, by, f"{cls_path} is missing (expected by {by})")
            return
        for member in dict.fromkeys(names):
            found = self.tree.class_member(cls, member)
            self.add(group, f"{cls_path}.{member}", by,
                     None if found is not None else f"{cls_path}.{member} is missing (expected by {by})")

    def digest(self, group: str, path: str, pinned: str, by: str) -> Found | None:
        found = self.tree.resolve(path)
        if found is None or found.node is None:
            self.add(group, path, by, f"{path} is missing (expected by {by})")
            return None
        have = self.tree.digest(found)
        self.add(group, path, by, None if have == pinned else
                 f"{path}: source digest {have}, pinned {pinned} (expected by {by})")
        return found


def check_tree(tree: SourceTree) -> Checker:
    """Every table's names against `tree`."""
    release = versions.release(tree.version)
    checker = Checker(tree)
    _common(checker, release)
    _worker(checker)
    _adapters(checker, release)
    _mrv2(checker, release)
    _emulation(checker, release)
    _imports(checker)
    return checker


def _common(checker: Checker, release: str) -> None:
    from runner_fsm.integrations.vllm import forked_plugins, platform_worker, serve, stop_origin
    from runner_fsm.integrations.vllm.common import schema
    from runner_fsm.integrations.vllm.cpu import collectives

    tree = checker.tree
    checker.name("common", forked_plugins.FLAG, "forked_plugins (the plugins again in a process vLLM forks)")
    for path, fields in schema.FIELDS.items():
        cls = checker.name("common", path, "the worker's schema (FIELDS)")
        if cls is not None and cls.kind == "class":
            have = tree.fields(cls)
            for field in fields:
                checker.add("common", f"{path}.{field}", "FIELDS",
                            None if field in have else f"{path}.{field} is missing (expected by the worker's schema: FIELDS)")
    for path in schema.SYMBOLS:
        checker.name("common", path, "the worker's schema (SYMBOLS)")
    checker.name("common", f"{versions.pick(serve.CLI_ENV_SETUP, release)}.cli_env_setup",
                 "runner_fsm.integrations.vllm.serve (CLI_ENV_SETUP)")
    for logger, (words, front) in stop_origin.SHUTDOWN_MESSAGES.items():
        module = tree.module(logger)
        by = f"stop_origin, which hears {front} stop"
        if module is None:
            checker.add("common", logger, by, f"{logger} is missing (expected by {by})")
        else:
            checker.add("common", f"{logger}: {words!r}", by, None if words in module.text else
                        f"{logger} no longer logs {words!r} (expected by {by})")
    for device, paths in platform_worker.WORKERS.items():
        for path in paths:
            if path.startswith("vllm."):
                checker.name("common", path, f"the {device} platform worker (platform_worker.WORKERS)")
    for cls_path in (collectives.BASE, collectives.COMMUNICATOR):
        checker.members("common", cls_path, collectives.EXCHANGES, "the CPU collectives (cpu/collectives.py)")


def _worker(checker: Checker) -> None:
    from runner_fsm.integrations.vllm import platform_worker
    from runner_fsm.integrations.vllm.common import schema

    for device, paths in platform_worker.WORKERS.items():
        for path in paths:
            if path.startswith("vllm."):
                checker.members("worker", path, schema.OVERRIDDEN, f"FSMWorker, which overrides it on {device}")
    texts = []
    for module_name in schema.CALLER_MODULES:
        module = checker.tree.module(module_name)
        if module is None:
            checker.add("worker", module_name, "CALLER_MODULES",
                        f"{module_name} is missing (where vLLM calls worker methods: CALLER_MODULES)")
        else:
            texts.append(module.text)
    called = schema.called_names(texts)
    for method in schema.CONTRACT:
        checker.add("worker", f"worker.{method}", "CONTRACT", None if method in called else
                    f"vLLM no longer calls worker method {method!r} (looked for in {', '.join(schema.CALLER_MODULES)};"
                    " expected by FSMWorker's CONTRACT)")


def _adapters(checker: Checker, release: str) -> None:
    from runner_fsm.integrations.vllm.runners import ADAPTERS
    from runner_fsm.integrations.vllm.runners.hooks import hooks_for

    for adapter in ADAPTERS:
        group = adapter.name
        for cls_path in adapter.CLASSES:
            if not cls_path.startswith("vllm."):
                checker.notes.setdefault(group, []).append(
                    f"{cls_path} is vLLM-Ascend's (tests/test_vllm_ascend_source.py): not in a vLLM tree")
                continue
            first = [path.split(".")[0].partition("[")[0] for path in adapter.ATTRS + adapter.KV_ATTRS]
            checker.members(group, cls_path, first, f"the {group} runner adapter (ATTRS, KV_ATTRS)")
            checker.members(group, cls_path, adapter.READS.get("runner", ()), f"the {group} runner adapter (READS)")
        _dp_hooks(checker, group, hooks_for(group, release))


def _dp_hooks(checker: Checker, group: str, hooks: Any) -> None:
    by = f"the {group} runner's DP hooks"
    for module, names in hooks.names.items():
        if checker.tree.module(module) is None:
            checker.add(group, module, by, f"{module} is missing (expected by {by})")
            continue
        for name in names:
            checker.name(group, f"{module}.{name}", by)
    for cls_path, methods in hooks.methods.items():
        checker.members(group, cls_path, methods, by)
    for path, params in hooks.signatures.items():
        found = checker.tree.resolve(path)
        if found is None or found.kind != "function":
            checker.add(group, path, by, f"{path} is missing (expected by {by})")
            continue
        have = parameters(found)
        checker.add(group, path, by, None if have == tuple(params) else
                    f"{path} takes ({', '.join(have)}), expected ({', '.join(params)}) by {by}")
    for module, function, text in hooks.sources:
        found = checker.tree.resolve(f"{module}.{function}")
        if found is None or found.node is None:
            checker.add(group, f"{module}.{function}", by, f"{module}.{function} is missing (expected by {by})")
            continue
        checker.add(group, f"{module}.{function}: {text}", by, None if text in checker.tree.source(found) else
                    f"{module}.{function} no longer calls {text!r} (expected by {by})")


def _mrv2(checker: Checker, release: str) -> None:
    """The PCP manager's names, the fast layout's pins and the draft DP sync's pins (MRV2 only)."""
    from runner_fsm.integrations.vllm.runners import draft_dp_sync, pcp_evidence, pcp_layout
    from runner_fsm.integrations.vllm.runners.mrv2 import MRV2Runner

    tree, manager = checker.tree, f"{pcp_layout.MODULE}.PCPManager"
    checker.members("mrv2", manager, [path.split(".")[0] for path in pcp_evidence.manager_names(release)],
                    "the MRV2 PCP evidence (pcp_evidence.manager_names)")
    checker.members("mrv2", manager, pcp_layout.INSTANCE_ATTRS, "fast_pcp_layout (pcp_layout.INSTANCE_ATTRS)")
    by = "fast_pcp_layout (pcp_layout.PINNED)"
    for method, (signature, pinned) in versions.pick(pcp_layout.PINNED, release).items():
        found = checker.digest("mrv2", f"{manager}.{method}", pinned, by)
        if found is not None and found.kind == "function":
            have = signature_text(tree, found)
            checker.add("mrv2", f"{manager}.{method}{signature}", by, None if have == signature else
                        f"{manager}.{method} takes {have}, pinned {signature} (expected by {by})")
    segment = checker.digest("mrv2", f"{pcp_layout.MODULE}.RankSegment", pcp_layout.SEGMENT_DIGEST,
                             "fast_pcp_layout (pcp_layout.SEGMENT_DIGEST)")
    if segment is not None and segment.kind == "class":
        fields = tuple(n.target.id for n in segment.node.body if isinstance(n, ast.AnnAssign))
        checker.add("mrv2", "RankSegment fields", "pcp_layout.SEGMENT_FIELDS",
                    None if fields == tuple(pcp_layout.SEGMENT_FIELDS) else
                    f"RankSegment fields {fields}, pinned {tuple(pcp_layout.SEGMENT_FIELDS)} (fast_pcp_layout)")
    for (module, qualname), pinned in versions.pick(draft_dp_sync.PINNED, release).items():
        checker.digest("mrv2", f"{module}.{qualname}", pinned, "draft_dp_sync (PINNED)")
    if release not in draft_dp_sync.VERIFIED:
        checker.notes.setdefault("mrv2", []).append(
            f"draft_dp_sync stays off on {release}: its reproduction has not run there (VERIFIED)")
    checker.members("mrv2", draft_dp_sync.SPECULATOR, MRV2Runner.READS.get("speculator", ()),
                    "the mrv2 runner adapter (READS, speculator)")
    for path in MRV2Runner.SYNC_FREE_SPECULATORS:
        checker.name("mrv2", path, "the mrv2 runner adapter (SYNC_FREE_SPECULATORS)")


def _emulation(checker: Checker, release: str) -> None:
    from runner_fsm.integrations.vllm.common.schema import WRITTEN_AGAINST
    from runner_fsm.integrations.vllm.emulation import graphs

    if not graphs.written_for(release):
        checker.notes.setdefault("emulation", []).append(
            f"it installs on vLLM {WRITTEN_AGAINST} only: emulation/graphs.install refuses {release}")
    for path in graphs.NAMES:
        checker.name("emulation", path, "the device emulation (emulation/graphs.NAMES)")


def _imports(checker: Checker) -> None:
    """Every `from vllm... import name` and `import vllm...` of this package's modules."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        group = next((g for prefix, g in _IMPORT_GROUPS if rel.startswith(prefix)), "common")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"]
            for target in targets:
                checker.name(group, target, f"runner_fsm/integrations/vllm/{rel}:{node.lineno}")


def report(checker: Checker) -> tuple[list[str], int]:
    """One line per group that holds (`[ok] mrv2: 41 names hold`), one per name that moved
    (`[moved] mrv2: ...`); the exit status: 0 when every name holds, else 1."""
    tree = checker.tree
    lines = [f"vLLM {tree.version} source at {tree.root}: checked against the tables of vLLM {checker.tables}"]
    if checker.unknown:
        lines.append(f"[unknown] vLLM {tree.version} is not a release this package was checked against;"
                     f" the tables of the nearest one, {checker.tables}, were read")
    for group in GROUPS:
        checks = [c for c in checker.checks if c.group == group]
        moved = list(dict.fromkeys(c.moved for c in checks if c.moved))
        notes = "".join(f" ({note})" for note in checker.notes.get(group, []))
        if not moved:
            lines.append(f"[ok] {group}: {len(checks)} names hold{notes}")
        else:
            lines += [f"[moved] {group}: {text}" for text in moved]
            held = sum(1 for c in checks if not c.moved)
            lines.append(f"[moved] {group}: {held} of {len(checks)} names hold, {len(checks) - held} moved{notes}")
    return lines, 1 if checker.unknown or any(c.moved for c in checker.checks) else 0


def run(source: str | None, *, installed: bool = False) -> int:
    """The subcommand: check the tree at `source` (a directory holding `vllm/`, or `vllm/`
    itself), or the installed vLLM's, found without running any of its code; print the report;
    the exit status (2: no tree, or one that cannot be parsed)."""
    if installed:
        spec = importlib.util.find_spec("vllm")  # finds the package; imports none of it
        if spec is None or not spec.submodule_search_locations:
            print("runner-fsm vllm-check: no vLLM is installed for this Python", file=sys.stderr)
            return 2
        root = Path(list(spec.submodule_search_locations)[0]).parent
    else:
        root = Path(source)
        root = root.parent if root.name == "vllm" and (root / "__init__.py").is_file() else root
    tree = SourceTree(root)  # OSError (the CLI's exit status 2) where it holds no vllm/
    try:
        checker = check_tree(tree)
    except (SyntaxError, UnicodeDecodeError) as exc:
        print(f"runner-fsm vllm-check: {root}: unreadable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    lines, code = report(checker)
    print("\n".join(lines))
    return code
