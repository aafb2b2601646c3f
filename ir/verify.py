"""The verifier: a graph is well-formed SSA whose recorded shapes agree with the op records.

Tests run it after every pass, so a rewrite that forgets a user, reorders a definition after its
use or records a stale shape fails at the pass that did it, with one line naming the node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .graph import Dim, Graph, Node, Shape, Value, eval_dim, eval_shape
from .ops import ELEMENTWISE_OPS, OPS, FusedElementwise

# symbol values at which two spellings of a symbolic dimension must agree ("2*T" vs "(T)+(T)")
_PROBE_ENVS = ({"T": 1, "P": 0}, {"T": 3, "P": 5}, {"T": 7, "P": 2}, {"T": 64, "P": 129})


class IRError(Exception):
    """A malformed graph. The message is one line naming the offending node or value."""


def dims_equal(a: Dim, b: Dim) -> bool:
    """Equal as written, or equal as functions of T and P (checked at a few points)."""
    if a == b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    try:
        return all(eval_dim(a, env) == eval_dim(b, env) for env in _PROBE_ENVS)
    except (ValueError, SyntaxError, NameError):
        return False


def shapes_equal(a: Shape, b: Shape) -> bool:
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b, strict=True))


def fmt_shape(shape: Shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _where(index: int, node: Node) -> str:
    outs = ", ".join(f"%{v.label}" for v in node.outputs) or "()"
    return f"node {index} ({outs} = {node.op})"


def verify(graph: Graph, env: dict[str, int] | None = None) -> None:
    """Raise IRError on the first problem found; `env` adds concrete checks (reshape sizes)."""
    defined = _check_leaves(graph)
    all_outputs = {v.id for n in graph.nodes for v in n.outputs}
    effect_nodes: list[tuple[int, Node]] = []
    for index, node in enumerate(graph.nodes):
        _check_node(index, node, defined, all_outputs, env)
        if OPS[node.op].effects:
            effect_nodes.append((index, node))
        for v in node.outputs:
            defined.add(v.id)
    _check_results(graph, defined)
    _check_effects_threaded(graph, effect_nodes)


def _check_leaves(graph: Graph) -> set[int]:
    defined: set[int] = set()
    leaves: list[tuple[str, Value]] = [("input", v) for v in graph.inputs]
    leaves += [(f"param {k}", p.value) for k, p in graph.params.items()]
    leaves += [(f"state {k}", s.value) for k, s in graph.states.items()]
    for what, v in leaves:
        if v.id in defined:
            raise IRError(f"{what}: value %{v.label} is defined twice")
        _check_dims(v.shape, f"{what} %{v.label}")
        defined.add(v.id)
    return defined


def _check_dims(shape: Iterable[Dim], what: str) -> None:
    for d in shape:
        try:
            eval_dim(d, {"T": 1, "P": 0})
        except (ValueError, SyntaxError, NameError, TypeError) as e:
            raise IRError(f"{what}: bad dimension {d!r} ({e})") from None


def _check_node(
    index: int, node: Node, defined: set[int], all_outputs: set[int], env: dict[str, int] | None
) -> None:
    where = _where(index, node)
    opdef = OPS.get(node.op)
    if opdef is None:
        raise IRError(f"{where}: unknown op {node.op!r}")
    if not isinstance(node.attrs, opdef.attrs):
        raise IRError(f"{where}: attrs must be {opdef.attrs.__name__}, got {type(node.attrs).__name__}")
    if isinstance(node.attrs, FusedElementwise):
        _check_program(where, node)
    for v in node.inputs:
        if v.id not in defined:
            why = "used before it is defined" if v.id in all_outputs else "never defined"
            raise IRError(f"{where}: input %{v.label} is {why}")
    for v in node.outputs:
        if v.id in defined:
            raise IRError(f"{where}: output %{v.label} is defined twice")
    _check_inferred(where, node)
    if env is not None:
        _check_concrete(where, node, env)


def _check_inferred(where: str, node: Node) -> None:
    try:
        specs = OPS[node.op].infer([(v.shape, v.dtype) for v in node.inputs], node.attrs)
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise IRError(f"{where}: shape rule rejects the inputs ({e})") from None
    if len(specs) != len(node.outputs):
        raise IRError(f"{where}: op has {len(specs)} outputs, node records {len(node.outputs)}")
    for v, (shape, dtype) in zip(node.outputs, specs, strict=True):
        if not shapes_equal(v.shape, shape) or v.dtype != dtype:
            raise IRError(
                f"{where}: %{v.label} recorded as {v.dtype}{fmt_shape(v.shape)}, "
                f"the shape rule gives {dtype}{fmt_shape(shape)}"
            )


def _check_program(where: str, node: Node) -> None:
    attrs: FusedElementwise = node.attrs
    if attrs.n_inputs != len(node.inputs):
        raise IRError(f"{where}: program expects {attrs.n_inputs} inputs, node has {len(node.inputs)}")
    if not attrs.program:
        raise IRError(f"{where}: empty elementwise program")
    for step, (op, step_attrs, operands) in enumerate(attrs.program):
        if op not in ELEMENTWISE_OPS or not isinstance(step_attrs, OPS[op].attrs):
            kind = type(step_attrs).__name__
            raise IRError(f"{where}: step {step} is not an elementwise op ({op}, {kind})")
        arity = 2 if op == "binary" else 1
        if len(operands) != arity or any(not 0 <= i < attrs.n_inputs + step for i in operands):
            raise IRError(f"{where}: step {step} has bad operands {operands}")


def _check_concrete(where: str, node: Node, env: dict[str, int]) -> None:
    """Under concrete T and P a reshape must keep its element count."""
    if node.op != "reshape":
        return
    try:
        src = math.prod(eval_shape(node.inputs[0].shape, env))
        dst = math.prod(eval_shape(node.outputs[0].shape, env))
    except (ValueError, SyntaxError, NameError) as e:
        raise IRError(f"{where}: cannot evaluate shapes under {env} ({e})") from None
    if src != dst:
        raise IRError(f"{where}: reshape of {src} elements into {dst} under {env}")


def _check_results(graph: Graph, defined: set[int]) -> None:
    for v in graph.outputs:
        if v.id not in defined:
            raise IRError(f"graph output %{v.label} is never defined")
    for name, v in graph.state_out.items():
        if name not in graph.states:
            raise IRError(f"state_out names unknown state {name!r}")
        if v.id not in defined:
            raise IRError(f"state_out {name!r} holds %{v.label}, which is never defined")
        s = graph.states[name].value
        if not shapes_equal(v.shape, s.shape) or v.dtype != s.dtype:
            raise IRError(f"state_out {name!r}: %{v.label} is {v.dtype}{fmt_shape(v.shape)}, "
                          f"the state is {s.dtype}{fmt_shape(s.shape)}")


def _check_effects_threaded(graph: Graph, effect_nodes: list[tuple[int, Node]]) -> None:
    """Each effect's result must reach state_out, directly or through later effects on it."""
    state_ids = {s.value.id for s in graph.states.values()}
    effect_out = {n.outputs[0].id for _, n in effect_nodes}
    threaded = {v.id for v in graph.state_out.values()}
    for _, node in reversed(effect_nodes):
        if node.outputs[0].id in threaded:
            threaded.add(node.inputs[0].id)
    for index, node in effect_nodes:
        where = _where(index, node)
        target = node.inputs[0]
        if target.id not in state_ids and target.id not in effect_out:
            raise IRError(f"{where}: writes %{target.label}, which is not a state or a state's new version")
        if node.outputs[0].id not in threaded:
            raise IRError(f"{where}: result %{node.outputs[0].label} never reaches state_out")
