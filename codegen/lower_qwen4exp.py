"""Lowering-table entries of qwen4exp's ops (kernels in `kernels_qwen4exp.py`).

`lower.py` merges `QWEN4EXP_LOWERING` into its table. The "attention" entry here extends the
plain causal one (which it calls for `mask="causal"`) with the additive-mask form (the unfused
QSA spelling) and the sparse form that reads only the selected cells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ggufc.ir import ops as O
from ggufc.ir.graph import Node

from . import kernels as K
from . import kernels_qwen4exp as KQ
from . import quant as Q
from .lower import LOWERING, FunctionContext, _weight_args

_causal_attention = LOWERING["attention"]


def _tensor_dims(fc: FunctionContext, node: Node) -> tuple[Any, ...]:
    return tuple(fc.kernel_key_dims(v) for v in node.inputs if v.shape != ())


def _args(fc: FunctionContext, node: Node) -> list[Any]:
    return [fc.pos() if v.shape == () else fc.value(v) for v in node.inputs]


def _hc_pre(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.HcPre = node.attrs
    r, _norm, down = node.inputs[:3]
    rank = int(down.shape[0])
    key = ("hc_pre", a, _tensor_dims(fc, node))
    return fc.call(key, lambda: KQ.hc_pre(fc.kernel_shape(r, K.Symbols()), rank, a.n_hc, a.eps, a.post),
                   _args(fc, node), node.outputs, node.outputs[0].name)


def _hc_post(fc: FunctionContext, node: Node) -> list[Any]:
    if node.attrs.comb:
        raise NotImplementedError("hc_post with a comb matrix (deepseek4) is not lowered yet")
    r = node.inputs[0]
    key = ("hc_post", _tensor_dims(fc, node))
    return fc.call(key, lambda: KQ.hc_post(fc.kernel_shape(r, K.Symbols())), _args(fc, node), node.outputs,
                   node.outputs[0].name)


def _indexer_score(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.IndexerScore = node.attrs
    q, cache = node.inputs[:2]
    n_cells = int(cache.shape[0])
    key = ("indexer_score", a, _tensor_dims(fc, node))
    return fc.call(key, lambda: KQ.indexer_score(fc.kernel_shape(q, K.Symbols()), n_cells, a.ratio, a.eps, a.n_rot),
                   _args(fc, node), node.outputs, node.outputs[0].name)


def _indexer_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.IndexerTopK = node.attrs
    nb1 = int(node.inputs[0].shape[1])
    n_cells = nb1 * a.ratio  # > n_ctx (the score rows cover n_ctx // r whole blocks plus the spare one)
    key = ("indexer_topk", a, nb1, n_cells)
    return fc.call(key, lambda: KQ.indexer_topk(nb1, a.ratio, a.width, n_cells), _args(fc, node), node.outputs,
                   node.outputs[0].name)


def _index_mask(fc: FunctionContext, node: Node) -> list[Any]:
    sel = node.inputs[0]
    key = ("index_mask", _tensor_dims(fc, node))
    return fc.call(key, lambda: KQ.index_mask(fc.kernel_shape(sel, K.Symbols())), _args(fc, node), node.outputs,
                   node.outputs[0].name)


def _attention(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.Attention = node.attrs
    if a.mask == "causal":
        return _causal_attention(fc, node)
    q, kc = node.inputs[:2]
    dims = _tensor_dims(fc, node)
    if a.mask == "indices":
        width = int(node.inputs[4].shape[1])
        key: tuple[Any, ...] = ("sparse_attention", a, dims)

        def make() -> Any:
            syms = K.Symbols()
            return KQ.sparse_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), width, a.scale)
    else:
        key = ("masked_attention", a, dims)

        def make() -> Any:
            syms = K.Symbols()
            return KQ.masked_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), a.scale)

    return fc.call(key, make, _args(fc, node), node.outputs, node.outputs[0].name)


def _ple_hash(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.PleHash = node.attrs
    n_cells = int(node.inputs[0].shape[0])
    key = ("ple_hash", a, n_cells)
    return fc.call(key, lambda: KQ.ple_hash(n_cells, a.ngram, a.heads_per_ngram, a.multipliers, a.offsets, a.sizes,
                                            a.eos), _args(fc, node), node.outputs, node.outputs[0].name)


# ---------------------------------------------------------------------------------------------
# moe_ffn extensions (called from lower._moe_ffn)


def merged_gate_up_act(fc: FunctionContext, y: Any, act_dims: tuple[Any, ...], act_shape: list[Any]) -> Any:
    """silu(y[..., :F]) * y[..., F:] of the merged gate_up experts' output [T, k, 2F]."""
    return fc.call_temp(("swiglu_halves", act_dims), lambda: KQ.swiglu_halves(K.Symbols().shape(act_dims)), [y],
                        [(act_shape, "float32")], "ffn_moe_act")[0]


def shared_expert(fc: FunctionContext, node: Node, named: dict[str, Any], routed: Any) -> list[Any]:
    """routed + (silu(x Wg [sg]) * (x Wu [su])) Wd [sd] * sigmoid(x . w): three projections (the
    quantized matmul kernels), one activation kernel, one kernel for the gate and the combine."""
    x = named["x"]
    t, t_dim, e = fc.dim(x.shape[0]), fc.kernel_key_dims(x)[0], int(x.shape[1])
    gemv = fc.is_one(x.shape[0])
    scales = named["shexp_scales"]

    def proj(inp: Any, w: Any, name: str) -> tuple[Any, int]:
        qtype, (n, k), arrays = _weight_args(fc, w)
        out = fc.call_temp(("matmul", qtype, n, k, gemv), lambda: Q.qmatmul(qtype, n, k, gemv=gemv), [inp, *arrays],
                           [([t, K.i64(n)], "float32")], name)[0]
        return out, n

    g, fs = proj(fc.value(x), named["shexp_gate"], "ffn_shexp_gate")
    u, _ = proj(fc.value(x), named["shexp_up"], "ffn_shexp_up")
    ins = [g, u]
    steps: list[tuple[str, Any, tuple[int, ...]]] = []
    dims: list[tuple[Any, ...]] = [(t_dim, fs), (t_dim, fs)]
    gate_slot, up_slot = 0, 1
    for kind in ("gate", "up"):
        if kind in scales:
            ins.append(fc.value(scales[kind]))
            dims.append((1,))
    n_in = len(ins)
    slot = {"gate": 2, "up": 3 if "gate" in scales else 2}
    for kind, src in (("gate", 0), ("up", 1)):
        if kind in scales:
            steps.append(("binary", O.Binary("mul"), (src, slot[kind])))
            if kind == "gate":
                gate_slot = n_in + len(steps) - 1
            else:
                up_slot = n_in + len(steps) - 1
    steps.append(("unary", O.Unary("silu"), (gate_slot,)))
    steps.append(("binary", O.Binary("mul"), (n_in + len(steps) - 1, up_slot)))
    prog = O.FusedElementwise(tuple(steps), n_in)
    key = ("elementwise", prog, tuple(dims))
    act = fc.call_temp(key, lambda: K.elementwise([K.Symbols().shape(d) for d in dims], prog), ins,
                       [([t, K.i64(fs)], "float32")], "ffn_shexp_act")[0]
    down, _ = proj(act, named["shexp_down"], "ffn_shexp_down")
    w_gate = named["shexp_gate_inp"]
    if fc.is_param(w_gate) and fc.param(w_gate)[0].qtype != "F32":
        raise NotImplementedError("a quantized ffn_gate_inp_shexp is not lowered (fuse_moe keeps it f32)")
    has_sd = "down" in scales
    args = [routed, down, fc.value(x), fc.value(w_gate)] + ([fc.value(scales["down"])] if has_sd else [])
    key2 = ("shared_combine", (t_dim, e), has_sd)
    return fc.call(key2, lambda: KQ.shared_combine(K.Symbols().shape((t_dim, e)), has_sd), args, node.outputs,
                   node.outputs[0].name)


QWEN4EXP_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "hc_pre": _hc_pre,
    "hc_post": _hc_post,
    "indexer_score": _indexer_score,
    "indexer_topk": _indexer_topk,
    "index_mask": _index_mask,
    "attention": _attention,
    "ple_hash": _ple_hash,
}
