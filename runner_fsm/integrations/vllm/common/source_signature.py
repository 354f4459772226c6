"""A function's signature as `str(inspect.signature(f))` prints it on the imported function, read
from the source (`source_index`): what `runners/pcp_layout.PINNED` pins besides the digest.

On import, annotations are evaluated (unless the module has `from __future__ import
annotations`, where they stay strings and print quoted) and printed by `inspect.formatannotation`:
a class as `module.qualname` (a builtin as its bare name), a generic as its repr. Here each name
of an annotation is resolved through the module's imports and the tree to where its class is
defined (`np.ndarray` -> `numpy.ndarray`, vLLM's classes -> their defining module).
"""

from __future__ import annotations

import ast

from runner_fsm.integrations.vllm.common.source_index import Found, SourceTree


def signature_text(tree: SourceTree, found: Found) -> str:
    """`str(inspect.signature(...))` of the def `found` names."""
    module, args = found.module, found.node.args

    def annotation(node: ast.AST | None) -> str:
        if node is None:
            return ""
        text = repr(ast.unparse(node)) if module.future_annotations else _render(tree, found, node)
        return f": {text}"

    def param(arg: ast.arg, default: ast.AST | None, prefix: str = "") -> str:
        note = annotation(arg.annotation)
        if default is None:
            return f"{prefix}{arg.arg}{note}"
        return f"{prefix}{arg.arg}{note}{' = ' if note else '='}{ast.unparse(default)}"

    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [param(a, d) for a, d in zip(positional, defaults)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg:
        parts.append(param(args.vararg, None, "*"))
    elif args.kwonlyargs:
        parts.append("*")
    parts += [param(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parts.append(param(args.kwarg, None, "**"))
    returns = f" -> {_render(tree, found, found.node.returns)}" if found.node.returns is not None else ""
    if returns and module.future_annotations:
        returns = f" -> {ast.unparse(found.node.returns)!r}"
    return f"({', '.join(parts)}){returns}"


def _render(tree: SourceTree, found: Found, node: ast.AST) -> str:
    module = found.module
    if isinstance(node, ast.Constant):
        return "None" if node.value is None else repr(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return f"{_render(tree, found, node.left)} | {_render(tree, found, node.right)}"
    if isinstance(node, ast.Subscript):
        inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return f"{_render(tree, found, node.value)}[{', '.join(_render(tree, found, n) for n in inner)}]"
    if isinstance(node, ast.Attribute):
        return f"{_render(tree, found, node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        target = module.imports.get(node.id)
        if target is None:
            if node.id in module.names:
                return f"{module.name}.{node.id}"
            return node.id  # a builtin (or a name the tree cannot place): bare, as inspect prints a builtin
        if target.startswith("vllm"):
            defined = tree.resolve(target)
            if defined is not None and defined.kind == "class":
                return f"{defined.module.name}.{defined.qualname}"
        return target
    return ast.unparse(node)
