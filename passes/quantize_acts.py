"""Round matmul inputs where llama.cpp does: `matmul(x, Wq)` -> `matmul(quantize_act(x), Wq)`.

For quantised weights (the 32-block types and the K-quants) llama.cpp's dot products read the
activations as 8-bit blocks (q8_0, q8_1 or q8_K, ir/act_quant.py); making that rounding an op gives
the compiled model llama.cpp's numerics, and lets codegen use integer dot-product kernels (which
re-quantise `x` themselves). Matmuls that share an input and a scheme share one `quantize_act`.
F16 weights read f16 activations (each value rounded to half precision; no 8-bit kernel applies).
Weights with block minimums (Q4_1/Q5_1) read q8_1: `matmul(xq, W, s)` with the block sums `s`.
A fused MoE records the schemes of its routed experts' inputs (`MoeFFN.act_schemes`; q8_0 for
Q4_1/Q5_1 experts, whose expert kernels have no block-sum input) and of its shared expert's
(`MoeFFN.shared_act_schemes`: gate/up input, down input, as the unfused matmuls would get them).
Runs after `fold_dequantize`, when a matmul reads its quantised param directly.
"""

from __future__ import annotations

import dataclasses

from ggufc.ir.act_quant import ACT_BLOCK, ACT_SCHEME, MIN_TYPES, SCHEME_BLOCK
from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.moe_routing import MoeFFN, moe_inputs
from ggufc.ir.ops import QuantizeAct

from .stats import with_hits


def _scheme(node: Node, params: dict[int, str]) -> str | None:
    """The activation scheme llama.cpp uses for this matmul's weight, or None."""
    if node.op not in ("matmul", "matmul_id", "head_matmul"):
        return None
    x, w = node.inputs[:2]
    qtype = params.get(w.id, "")
    scheme = "q8_1" if node.op == "matmul" and qtype in MIN_TYPES else ACT_SCHEME.get(qtype)  # per-slot kernels: q8_0
    k = x.shape[-1]
    return scheme if scheme and isinstance(k, int) and k % SCHEME_BLOCK[scheme] == 0 else None


def _pair_schemes(ups: list[Value], down: Value, e: object, params: dict[int, str]) -> tuple[str, str]:
    """The schemes of an FFN's gate/up input (one scheme for all `ups`, or none) and down input."""
    in_schemes = {ACT_SCHEME.get(params.get(w.id, "")) for w in ups}
    down_scheme = ACT_SCHEME.get(params.get(down.id, ""))
    hidden = int(down.shape[-1])
    in_scheme = in_schemes.pop() if len(in_schemes) == 1 else None
    if in_scheme and not (isinstance(e, int) and e % SCHEME_BLOCK[in_scheme] == 0):
        in_scheme = None
    if down_scheme and hidden % SCHEME_BLOCK[down_scheme]:
        down_scheme = None
    return in_scheme or "", down_scheme or ""


def _expert_schemes(node: Node, params: dict[int, str]) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """The schemes of a moe_ffn's routed experts and of its shared expert (each (gate/up input,
    down input)), or None when there is none to set."""
    a: MoeFFN = node.attrs
    named = moe_inputs(node.inputs, a)
    e = node.inputs[0].shape[-1]
    routed = _pair_schemes([named[k] for k in ("gate", "up", "gate_up") if k in named], named["down"], e, params)
    shared = ("", "")
    if a.shared:
        shared = _pair_schemes([named["shexp_gate"], named["shexp_up"]], named["shexp_down"], e, params)
    if routed == shared == ("", "") or (a.act_schemes, a.shared_act_schemes) != (("", ""), ("", "")):
        return None
    return routed, shared


def quantize_activations(graph: Graph) -> Graph:
    params = {p.value.id: p.qtype for p in graph.params.values()}
    already = {n.outputs[0].id for n in graph.nodes if n.op == "quantize_act"}
    rounded: dict[tuple[int, str], tuple[Value, ...]] = {}  # (input id, scheme) -> quantize_act outputs
    nodes: list[Node] = []
    experts = 0
    for node in graph.nodes:
        if node.op == "moe_ffn" and (schemes := _expert_schemes(node, params)) is not None:
            attrs = dataclasses.replace(node.attrs, act_schemes=schemes[0], shared_act_schemes=schemes[1])
            nodes.append(Node(node.op, node.inputs, attrs, node.outputs))
            experts += 1
            continue
        scheme = _scheme(node, params)
        if scheme is None or node.inputs[0].id in already:
            nodes.append(node)
            continue
        x = node.inputs[0]
        if (x.id, scheme) not in rounded:
            outs: tuple[Value, ...] = (Value(f"{x.name}_{scheme}", x.shape, x.dtype, x.layer),)
            if scheme == "q8_1":
                sums_shape = (*x.shape[:-1], int(x.shape[-1]) // ACT_BLOCK)
                outs += (Value(f"{x.name}_{scheme}_sums", sums_shape, "float32", x.layer),)
            nodes.append(Node("quantize_act", (x,), QuantizeAct(scheme), outs))
            rounded[x.id, scheme] = outs
        xq, *sums = rounded[x.id, scheme]
        nodes.append(Node(node.op, (xq, *node.inputs[1:], *sums), node.attrs, node.outputs))
    hits = len(rounded) + experts
    return with_hits(graph.replace(nodes=nodes), "quantize_activations", hits) if hits else graph
