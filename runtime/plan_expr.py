"""Launch-size expressions of GPU plans, evaluated safely.

A plan (manifest + `plan.json` of a vulkan or metal artifact) gives grid sizes, POD kernel
arguments and buffer sizes as small integer expressions over the step's symbolic sizes, e.g.
`((n + 31) // 32)` or `min(p + n, 2048)`. They are read from an artifact, so they are parsed
with `ast` and only integer literals, known names, `+ - * // %`, unary minus and `min`/`max`
are accepted; anything else is refused before any code object exists. Accepted expressions
of one function are compiled once into a single function of those names.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence

from ggufc.messages import GgufcError

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
MAX_EXPR_CHARS = 4096


class PlanExprError(GgufcError, ValueError):
    """An expression in a plan that is not a plain integer expression."""


def check(text: str, names: Sequence[str]) -> ast.expr:
    if not isinstance(text, str) or len(text) > MAX_EXPR_CHARS:
        raise PlanExprError(f"plan expression {text!r:.60} is not a short string")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise PlanExprError(f"plan expression {text!r:.60} does not parse") from None
    allowed = set(names)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise PlanExprError(f"plan expression {text!r:.60}: only integer literals")
        elif isinstance(node, ast.Name):
            if node.id not in allowed:
                raise PlanExprError(f"plan expression {text!r:.60}: unknown name {node.id!r}")
        elif isinstance(node, ast.BinOp):
            if not isinstance(node.op, _BINOPS):
                raise PlanExprError(f"plan expression {text!r:.60}: operator not allowed")
            visit(node.left)
            visit(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            visit(node.operand)
        elif isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in ("min", "max")) or node.keywords \
                    or len(node.args) < 2:
                raise PlanExprError(f"plan expression {text!r:.60}: only min()/max() calls")
            for a in node.args:
                visit(a)
        else:
            raise PlanExprError(f"plan expression {text!r:.60}: {type(node).__name__} not allowed")

    visit(tree.body)
    return tree.body


def compile_many(texts: Sequence[str], names: Sequence[str]) -> Callable[..., tuple[int, ...]]:
    """One function `f(*values_of_names) -> tuple of ints` evaluating every expression."""
    bodies = [check(t, names) for t in texts]
    args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in names], kwonlyargs=[], kw_defaults=[],
                         defaults=[])
    fn = ast.Lambda(args=args, body=ast.Tuple(elts=bodies, ctx=ast.Load()))
    module = ast.Expression(body=fn)
    ast.fix_missing_locations(module)
    code = compile(module, "<plan>", "eval")
    return eval(code, {"__builtins__": {"min": min, "max": max}})  # noqa: S307 - whitelisted above


def evaluate(text: str, values: dict[str, int]) -> int:
    return int(compile_many([text], list(values))(*values.values())[0])
