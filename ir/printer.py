"""Readable text for a graph: a header of inputs, params and states, then one line per node.

    %attn_norm@3:float32[T,576] = rms_norm(%l_out@2, %blk.3.attn_norm.weight) eps=1e-05

Parameter names already carry their block (`blk.3.`), so operands that are parameters are
printed by name alone; every other value as `name@layer`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from .graph import Graph, Node, Value
from .ops import FusedElementwise


def fmt_value(v: Value) -> str:
    dims = ",".join(str(d) for d in v.shape)
    return f"%{v.label}:{v.dtype}[{dims}]"


def fmt_attr(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:g}"
    if isinstance(x, tuple):
        return "(" + ",".join(fmt_attr(e) for e in x) + ")"
    return str(x)


def fmt_attrs(attrs: Any) -> str:
    if isinstance(attrs, FusedElementwise):
        return "expr=" + fmt_program(attrs)
    if not dataclasses.is_dataclass(attrs):
        return ""
    return " ".join(f"{f.name}={fmt_attr(getattr(attrs, f.name))}" for f in dataclasses.fields(attrs))


def fmt_program(attrs: FusedElementwise) -> str:
    """The program as one nested expression over its inputs $0, $1, ..."""
    exprs = [f"${i}" for i in range(attrs.n_inputs)]
    for op, step_attrs, operands in attrs.program:
        args = [exprs[i] for i in operands]
        if op == "scalar":
            args.append(fmt_attr(step_attrs.c))
        exprs.append(f"{step_attrs.fn}({', '.join(args)})")
    return exprs[-1]


def fmt_node(node: Node, param_ids: set[int] | frozenset[int] = frozenset()) -> str:
    outs = ", ".join(fmt_value(v) for v in node.outputs)
    ins = ", ".join(f"%{v.name}" if v.id in param_ids else f"%{v.label}" for v in node.inputs)
    attrs = fmt_attrs(node.attrs)
    return f"{outs} = {node.op}({ins})" + (f" {attrs}" if attrs else "")


def _header(graph: Graph) -> list[str]:
    meta = " ".join(f"{k}={v}" for k, v in graph.meta.items() if isinstance(v, str | int | float | bool))
    lines = [f"graph {meta}".rstrip()]
    lines.append("inputs: " + ", ".join(fmt_value(v) for v in graph.inputs))
    by_type = Counter(p.qtype for p in graph.params.values())
    n_elems = sum(_numel(p.value) for p in graph.params.values())
    kinds = ", ".join(f"{q} {n}" for q, n in sorted(by_type.items()))
    lines.append(f"params: {len(graph.params)} ({kinds}), {n_elems:,} elements")
    lines.append(f"states: {len(graph.states)}")
    lines += [f"  {fmt_value(s.value)} init={s.init}" for s in graph.states.values()]
    return lines


def _numel(v: Value) -> int:
    n = 1
    for d in v.shape:
        n *= d if isinstance(d, int) else 1
    return n


def dump(graph: Graph, *, params: bool = False) -> str:
    """The whole graph as text; `params=True` also lists every parameter."""
    lines = _header(graph)
    if params:
        lines += [f"  {fmt_value(p.value)} {p.qtype} <- {p.source}" for p in graph.params.values()]
    param_ids = {p.value.id for p in graph.params.values()}
    lines.append("")
    lines += [fmt_node(n, param_ids) for n in graph.nodes]
    lines.append("")
    lines.append("return " + ", ".join(fmt_value(v) for v in graph.outputs))
    lines += [f"state {name} <- %{v.label}" for name, v in graph.state_out.items()]
    return "\n".join(lines) + "\n"
