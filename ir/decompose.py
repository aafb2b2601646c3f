"""Decompositions: every fused op spelled in primitives.

`decompose(graph)` replaces each fused node by its primitives, emitted through a GraphBuilder
under the node's layer and named after its output (`attn.scores@3`). The fused node's output
values are kept as the outputs of the last primitives, so users, graph outputs and state_out
need no rewiring. The decomposed graph run by the interpreter must match the fused one: that is
how every fused kernel's meaning is pinned to the primitive references.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from . import ops as O
from .builder import GraphBuilder, rms_norm_spelled
from .graph import Graph, Node, Value, mul_dim
from .hyper_connections_spelled import HC_DECOMPOSITIONS
from .linear_attention_spelled import LINEAR_ATTENTION_DECOMPOSITIONS
from .moe_routing_spelled import MOE_DECOMPOSITIONS
from .sparse_indexers import BlockMask
from .sparse_indexers_spelled import INDEXER_DECOMPOSITIONS
from .verify import IRError, fmt_shape, shapes_equal

Decomposition = Callable[[GraphBuilder, Node], list[Value]]


# ---------------------------------------------------------------------------------------------
# spelled blocks (the same spellings the frontend emits)


def softmax_spelled(b: GraphBuilder, x: Value, axis: int, name: str) -> Value:
    m = b.reduce("max", x, f"{name}.max", axis=axis)
    e = b.unary("exp", b.binary("sub", x, m, f"{name}.shift"), f"{name}.exp")
    return b.binary("div", e, b.reduce("sum", e, f"{name}.sum", axis=axis), name)


def softmax_with_sinks_spelled(b: GraphBuilder, x: Value, sinks: Value, name: str) -> Value:
    """Softmax over the last axis with the per-row extra logit `sinks` (broadcast against x, last
    dim 1) in the max and the denominator: ggml_soft_max_ext with sinks."""
    m = b.binary("max", b.reduce("max", x, f"{name}.rowmax", axis=-1), sinks, f"{name}.max")
    e = b.unary("exp", b.binary("sub", x, m, f"{name}.shift"), f"{name}.exp")
    sink_e = b.unary("exp", b.binary("sub", sinks, m, f"{name}.sink_shift"), f"{name}.sink_exp")
    total = b.add(b.reduce("sum", e, f"{name}.rowsum", axis=-1), sink_e, f"{name}.sum")
    return b.binary("div", e, total, name)


# ---------------------------------------------------------------------------------------------
# one decomposition per fused op


def _softmax(b: GraphBuilder, n: Node) -> list[Value]:
    return [softmax_spelled(b, n.inputs[0], n.attrs.axis, n.outputs[0].name)]


def _rms_norm(b: GraphBuilder, n: Node) -> list[Value]:
    w = n.inputs[1] if len(n.inputs) > 1 else None
    return [rms_norm_spelled(b, n.inputs[0], w, n.attrs.eps, n.outputs[0].name)]


def _swiglu(b: GraphBuilder, n: Node) -> list[Value]:
    name = n.outputs[0].name
    return [b.mul(b.unary("silu", n.inputs[0], f"{name}.silu"), n.inputs[1], name)]


def _rope(b: GraphBuilder, n: Node) -> list[Value]:
    """Rotate pairs by the table rows of this call's positions (gathered, not sliced by P)."""
    x, pos, table = n.inputs
    a: O.Rope = n.attrs
    name, (t, h, d) = n.outputs[0].name, x.shape
    half = a.n_rot // 2
    rows = b.gather(table, b.emit("positions", [pos], O.Tokens(t), f"{name}.pos"), f"{name}.cs")
    cos, sin = b.slice(rows, 2, 0, 1, f"{name}.cos"), b.slice(rows, 2, 1, 2, f"{name}.sin")
    rest = [b.slice(x, 2, a.n_rot, int(d), f"{name}.pass")] if a.n_rot < int(d) else []
    xr = b.slice(x, 2, 0, a.n_rot, f"{name}.rot") if rest else x
    if a.mode in ("neox", "imrope"):  # halves: (x[:half], x[half:n_rot]); imrope's sections are in the table
        c, s = b.reshape(cos, (t, 1, half), f"{name}.c"), b.reshape(sin, (t, 1, half), f"{name}.s")
        lo, hi = b.slice(xr, 2, 0, half, f"{name}.lo"), b.slice(xr, 2, half, a.n_rot, f"{name}.hi")
        parts = _rotate(b, lo, hi, c, s, name)
    else:  # "norm": adjacent pairs, seen as a trailing axis of 2
        pairs = b.reshape(xr, (t, h, half, 2), f"{name}.pairs")
        c, s = b.reshape(cos, (t, 1, half, 1), f"{name}.c"), b.reshape(sin, (t, 1, half, 1), f"{name}.s")
        lo, hi = b.slice(pairs, 3, 0, 1, f"{name}.lo"), b.slice(pairs, 3, 1, 2, f"{name}.hi")
        rotated = b.emit("concat", _rotate(b, lo, hi, c, s, name), O.Concat(3), f"{name}.rotpairs")
        parts = [b.reshape(rotated, (t, h, a.n_rot), f"{name}.rotated")]
    parts += rest
    if len(parts) == 1:
        return parts
    return [b.emit("concat", parts, O.Concat(2), name)]


def _rotate(b: GraphBuilder, lo: Value, hi: Value, c: Value, s: Value, name: str) -> list[Value]:
    new_lo = b.binary("sub", b.mul(lo, c, f"{name}.lo_c"), b.mul(hi, s, f"{name}.hi_s"), f"{name}.new_lo")
    new_hi = b.add(b.mul(lo, s, f"{name}.lo_s"), b.mul(hi, c, f"{name}.hi_c"), f"{name}.new_hi")
    return [new_lo, new_hi]


def _selection_mask(b: GraphBuilder, n: Node, pos: Value, name: str) -> Value:
    extra = n.inputs[4]
    if n.attrs.mask == "additive":
        return extra
    if n.attrs.mask == "blocks":
        return b.emit("block_mask", [extra, pos], BlockMask(n.attrs.block), f"{name}.sel_mask")
    return b.emit("index_mask", [extra, pos], O.NoAttrs(), f"{name}.sel_mask")


def _attention(b: GraphBuilder, n: Node) -> list[Value]:
    """Causal GQA over the cache: query heads are grouped under their KV head, so one batched
    matmul per KV head serves its whole group (no repeat of K/V). An `f16_pv_below` rounding (a
    per-cell scan, llama.cpp's CPU backend) has no primitive spelling: the spelled form
    accumulates in float32, as the GPU targets do."""
    q, kc, vc, pos, *extra = n.inputs
    name, (t, h, d) = n.outputs[0].name, q.shape
    hkv = int(kc.shape[1])
    g = int(h) // hkv
    gt = mul_dim(g, t)
    k = b.transpose(b.emit("cache_read", [kc, pos], O.Tokens(t), f"{name}.k"), (1, 0, 2), f"{name}.kt")
    v = b.transpose(b.emit("cache_read", [vc, pos], O.Tokens(t), f"{name}.v"), (1, 0, 2), f"{name}.vt")
    qg = b.transpose(b.reshape(q, (t, hkv, g, d), f"{name}.q4"), (1, 2, 0, 3), f"{name}.qg")
    q3 = b.reshape(qg, (hkv, gt, d), f"{name}.q3")
    qk = b.emit("bmm_nt", [q3, k], O.NoAttrs(), f"{name}.qk")
    if n.attrs.softcap:  # c * tanh(s * (1/c)) before the scale, as ggml_scale, ggml_tanh, ggml_scale
        cap = np.float32(n.attrs.softcap)
        qk = b.scalar("mul", qk, float(np.float32(1.0) / cap), f"{name}.capped_in")
        qk = b.scalar("mul", b.unary("tanh", qk, f"{name}.capped_tanh"), float(cap), f"{name}.capped")
    scores = b.scalar("mul", qk, n.attrs.scale, f"{name}.scaled")
    s_len = scores.shape[2]
    mask = b.emit("causal_mask", [pos], O.Tokens(t), f"{name}.mask")
    if n.attrs.window:
        window = b.emit("window_mask", [pos], O.WindowMask(n.attrs.window, t), f"{name}.window_mask")
        mask = b.add(mask, window, f"{name}.mask_window")
    if n.attrs.mask != "causal":  # the selected cells as an additive mask (the sparse form's meaning)
        sel = _selection_mask(b, n, pos, name)
        if len(sel.shape) == 3:  # one mask per KV group: [Hkv, 1, T, P+T] against the grouped scores
            sel = b.reshape(sel, (hkv, 1, t, sel.shape[2]), f"{name}.sel_mask4")
        mask = b.add(mask, sel, f"{name}.mask_sel")
    masked = b.add(b.reshape(scores, (hkv, g, t, s_len), f"{name}.s4"), mask, f"{name}.masked")
    if n.attrs.sinks:
        probs = softmax_with_sinks_spelled(b, masked, b.reshape(extra[0], (hkv, g, 1, 1), f"{name}.sinks4"),
                                           f"{name}.probs")
    else:
        probs = softmax_spelled(b, masked, -1, f"{name}.probs")
    out = b.emit("bmm_nn", [b.reshape(probs, (hkv, gt, s_len), f"{name}.p3"), v], O.NoAttrs(), f"{name}.pv")
    heads = b.transpose(b.reshape(out, (hkv, g, t, d), f"{name}.o4"), (2, 0, 1, 3), f"{name}.ot")
    return [b.reshape(heads, (t, h, d), name)]


def _fused_elementwise(b: GraphBuilder, n: Node) -> list[Value]:
    a: O.FusedElementwise = n.attrs
    name = n.outputs[0].name
    vals = list(n.inputs)
    for step, (op, attrs, operands) in enumerate(a.program):
        vals.append(b.emit(op, [vals[i] for i in operands], attrs, f"{name}.{step}"))
    return [vals[-1]]


def _rounded(b: GraphBuilder, x: Value, scheme: str, name: str) -> tuple[Value, ...]:
    """quantize_act's outputs: x rounded, and the q8_1 block sums."""
    names = [f"{name}.in_q"] + ([f"{name}.in_q_sums"] if scheme == "q8_1" else [])
    return b.emit_multi("quantize_act", [x], O.QuantizeAct(scheme), names)


def _int8_matmul(b: GraphBuilder, n: Node) -> list[Value]:
    x, w = n.inputs
    rounded = _rounded(b, x, n.attrs.scheme, n.outputs[0].name)
    return [b.emit("matmul", [rounded[0], w, *rounded[1:]], O.NoAttrs(), n.outputs[0].name)]


def _int8_gemv_group(b: GraphBuilder, n: Node) -> list[Value]:
    """The prologue's op (rms_norm or swiglu), one rounding, the matmuls, the residual add."""
    a: O.GemvGroup = n.attrs
    name = n.outputs[0].name
    pro, weights = n.inputs[: a.n_prologue], n.inputs[a.n_prologue : a.n_prologue + a.n_weights]
    if a.prologue == "rms_norm":
        x = b.emit("rms_norm", list(pro), O.RMSNorm(a.eps), f"{name}.norm")
    elif a.prologue == "swiglu":
        x = b.emit("swiglu", list(pro), O.NoAttrs(), f"{name}.act")
    else:
        x = pro[0]
    rounded = _rounded(b, x, a.scheme, name)

    def matmul(w: Value, out_name: str) -> Value:
        return b.emit("matmul", [rounded[0], w, *rounded[1:]], O.NoAttrs(), out_name)

    if a.residual:
        return [b.add(matmul(weights[0], f"{name}.mm"), n.inputs[-1], name)]
    return [matmul(w, o.name) for w, o in zip(weights, n.outputs, strict=True)]


DECOMPOSITIONS: dict[str, Decomposition] = {
    "softmax": _softmax,
    "rms_norm": _rms_norm,
    "rope": _rope,
    "attention": _attention,
    "swiglu": _swiglu,
    "fused_elementwise": _fused_elementwise,
    "int8_matmul": _int8_matmul,
    "int8_gemv_group": _int8_gemv_group,
    **HC_DECOMPOSITIONS,  # spelled as the frontend blocks spell them
    **INDEXER_DECOMPOSITIONS,
    **LINEAR_ATTENTION_DECOMPOSITIONS,
    **MOE_DECOMPOSITIONS,
}


# ---------------------------------------------------------------------------------------------
# the pass


def decompose_node(node: Node) -> list[Node]:
    """Primitive nodes computing `node`, whose last definitions are `node`'s own outputs."""
    b = GraphBuilder()
    with b.layer(node.outputs[0].layer):
        results = DECOMPOSITIONS[node.op](b, node)
    rename: dict[int, Value] = {}
    for new, old in zip(results, node.outputs, strict=True):
        if not shapes_equal(new.shape, old.shape) or new.dtype != old.dtype:
            raise IRError(
                f"decomposition of {node.op} gives {new.dtype}{fmt_shape(new.shape)} "
                f"for %{old.label}:{old.dtype}{fmt_shape(old.shape)}"
            )
        rename[new.id] = old
    defined = {v.id for n in b.nodes for v in n.outputs}
    if not all(v.id in defined for v in results):
        raise IRError(f"decomposition of {node.op} returns a value it did not compute")
    return [_renamed(n, rename) for n in b.nodes]


def _renamed(node: Node, rename: dict[int, Value]) -> Node:
    def sub(vs: tuple[Value, ...]) -> tuple[Value, ...]:
        return tuple(rename.get(v.id, v) for v in vs)

    return Node(node.op, sub(node.inputs), node.attrs, sub(node.outputs))


def decompose(graph: Graph, only: Collection[str] | None = None) -> Graph:
    """Replace fused nodes (all of them, or those whose op is in `only`) by primitives.

    Decompositions may emit fused ops' spellings that contain no fused ops, so one sweep is
    enough; it is repeated until nothing fused (and selected) is left all the same.
    """
    nodes = graph.nodes
    while True:
        todo = {id(n) for n in nodes if O.OPS[n.op].fused and (only is None or n.op in only)}
        if not todo:
            return graph.replace(nodes=nodes)
        nodes = [m for n in nodes for m in (decompose_node(n) if id(n) in todo else [n])]
