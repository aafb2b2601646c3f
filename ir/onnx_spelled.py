"""Standard-ONNX spellings of the primitives `to_onnx` otherwise writes as `ggufc` nodes.

With `to_onnx(..., standard=True)` every node is a standard ONNX op, so onnxruntime runs the
graph as it is: positions and masks from `Range`, cache reads and writes as `Slice` + `Concat`
at the dynamic position, MoE expert matmuls as a `Gather` of expert rows under a batched
`MatMul`, the causal conv as a grouped `Conv`, the gated delta rule and lightning attention as a
`Scan` over tokens,
qwen4exp's PLE n-gram hash in uint64 arithmetic, its QSA cell values, heap selection
(`onnx_heap`) and index mask, minimax-m3's MSA block selection (`TopK` over values that put the
local blocks first) and per-group block mask, deepseek4's compressed-row scores and attention
(one softmax over the window's cells, the complete or selected rows and the sink), and symbolic
dims (`P+T`, `2*T`) computed from the token count and the start position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, helper, numpy_helper

from .graph import Node
from .linear_attention import GatedDeltaNet, LightningAttention, k_head_index
from .ngram_embedding import PleHash
from .onnx_heap import Body, heap_select
from .onnx_writer import OnnxWriter
from .sparse_indexers import BlockTopK, CompressedAttention, IndexerTopK, TokenTopK

INT64_MAX = int(np.iinfo(np.int64).max)





def _unsqueeze(e: OnnxWriter, x: str, axes: list[int], base: str) -> str:
    out = e.fresh(base)
    e.emit("Unsqueeze", [x, e.ints(f"{out}/axes", axes)], [out])
    return out


def _squeeze(e: OnnxWriter, x: str, axes: list[int], out: str) -> str:
    e.emit("Squeeze", [x, e.ints(f"{out}/axes", axes)], [out])
    return out


def _range(e: OnnxWriter, start: str, stop: str, base: str) -> str:
    out = e.fresh(base)
    e.emit("Range", [start, stop, e.const(f"{out}/step", np.asarray(1, np.int64))], [out])
    return out


def _slice(e: OnnxWriter, x: str, start: str, stop: str, axis: int, base: str) -> str:
    out = e.fresh(base)
    e.emit("Slice", [x, start, stop, e.ints(f"{out}/axes", [axis])], [out])
    return out


# -- one spelling per op -----------------------------------------------------------------------


def spell_positions(e: OnnxWriter, node: Node) -> None:
    out = e.name(node.outputs[0])
    s = e.symbols
    cells = _range(e, s.scalar("P"), s.scalar("P+T"), f"{out}/int64")
    e.emit("Cast", [cells], [out], to=TensorProto.INT32)


def spell_causal_mask(e: OnnxWriter, node: Node) -> None:
    """[T, P+T]: 0 where cell j <= P + i, -inf after."""
    out = e.name(node.outputs[0])
    s = e.symbols
    cells = _range(e, e.const(f"{out}/zero", np.asarray(0, np.int64)), s.scalar("P+T"), f"{out}/cells")
    rows = _unsqueeze(e, _range(e, s.scalar("P"), s.scalar("P+T"), f"{out}/rows"), [1], f"{out}/rows_col")
    seen = e.fresh(f"{out}/seen")
    e.emit("LessOrEqual", [cells, rows], [seen])
    zero, ninf = (e.const(f"{out}/{k}", np.asarray(v, np.float32)) for k, v in (("zero_f", 0.0), ("ninf", -np.inf)))
    e.emit("Where", [seen, zero, ninf], [out])


def spell_window_mask(e: OnnxWriter, node: Node) -> None:
    """[T, P+T]: -inf where cell j <= P + i - window, 0 elsewhere."""
    out = e.name(node.outputs[0])
    s = e.symbols
    cells = _range(e, e.const(f"{out}/zero", np.asarray(0, np.int64)), s.scalar("P+T"), f"{out}/cells")
    rows = _unsqueeze(e, _range(e, s.scalar("P"), s.scalar("P+T"), f"{out}/rows"), [1], f"{out}/rows_col")
    back, seen = e.fresh(f"{out}/back"), e.fresh(f"{out}/seen")
    e.emit("Sub", [rows, cells], [back])
    e.emit("Less", [back, e.const(f"{out}/window", np.asarray(node.attrs.window, np.int64))], [seen])
    zero, ninf = (e.const(f"{out}/{k}", np.asarray(v, np.float32)) for k, v in (("zero_f", 0.0), ("ninf", -np.inf)))
    e.emit("Where", [seen, zero, ninf], [out])


def spell_cache_write(e: OnnxWriter, node: Node) -> None:
    """cache[:P] ++ x ++ cache[P+T:] (the cache's length is static, so the result keeps it)."""
    cache, x, _ = (e.name(v) for v in node.inputs)
    out, s = e.name(node.outputs[0]), e.symbols
    head = _slice(e, cache, e.ints(f"{out}/zero", [0]), s.tensor("P"), 0, f"{out}/head")
    tail = _slice(e, cache, s.tensor("P+T"), e.ints(f"{out}/end", [INT64_MAX]), 0, f"{out}/tail")
    e.emit("Concat", [head, x, tail], [out], axis=0)


def spell_cache_read(e: OnnxWriter, node: Node) -> None:
    out = e.name(node.outputs[0])
    e.emit("Slice", [e.name(node.inputs[0]), e.ints(f"{out}/zero", [0]), e.symbols.tensor("P+T"),
                     e.ints(f"{out}/axes", [0])], [out])


def spell_matmul_id(e: OnnxWriter, node: Node) -> None:
    """x [T,S,K], w [X,N,K], ids [T,k] -> [T,k,N]: each token's expert rows, one batched MatMul."""
    x, w, ids = (e.name(v) for v in node.inputs)
    out = e.name(node.outputs[0])
    rows = e.fresh(f"{out}/experts")  # [T, k, N, K]
    e.emit("Gather", [w, ids], [rows], axis=0)
    prod = e.fresh(f"{out}/col")  # [T, k, N, 1]; S = 1 broadcasts over k
    e.emit("MatMul", [rows, _unsqueeze(e, x, [-1], f"{out}/x_col")], [prod])
    _squeeze(e, prod, [-1], out)


def spell_ssm_conv(e: OnnxWriter, node: Node) -> None:
    """A depthwise Conv (cross-correlation, as ssm_conv_ref) over [history | x^T]; the new
    history is the last (K-1)*dilation columns."""
    state, x, w = (e.name(v) for v in node.inputs)
    new_state, out = (e.name(v) for v in node.outputs)
    n_ch, width = (int(d) for d in node.inputs[2].shape)
    dilation = node.attrs.dilation
    hist = (width - 1) * dilation
    if hist == 0:
        raise ValueError(f"ssm_conv {out}: a width-1 conv keeps no history")
    xt = e.fresh(f"{out}/xT")
    e.emit("Transpose", [x], [xt], perm=[1, 0])
    xin = e.fresh(f"{out}/xin")  # [C, hist + T]
    e.emit("Concat", [state, xt], [xin], axis=1)
    conv = e.fresh(f"{out}/conv")
    e.emit("Conv", [_unsqueeze(e, xin, [0], f"{out}/batch"), _unsqueeze(e, w, [1], f"{out}/w")], [conv],
           group=n_ch, dilations=[dilation], kernel_shape=[width])
    y = _squeeze(e, conv, [0], e.fresh(f"{out}/ct"))
    e.emit("Transpose", [y], [out], perm=[1, 0])
    e.emit("Slice", [xin, e.ints(f"{new_state}/start", [-hist]), e.ints(f"{new_state}/end", [INT64_MAX]),
                     e.ints(f"{new_state}/axes", [1])], [new_state])


def spell_gated_delta_net(e: OnnxWriter, node: Node) -> None:
    """A Scan over tokens carrying M [Hv, Dv, Dk]: decay, delta write, read (gated_delta_net_ref)."""
    state, q, k, v, g, beta = (e.name(i) for i in node.inputs)
    new_state, out = (e.name(o) for o in node.outputs)
    a: GatedDeltaNet = node.attrs
    n_v, n_k = int(node.inputs[3].shape[1]), int(node.inputs[1].shape[1])
    kmap = e.ints(f"{out}/kmap", [int(i) for i in k_head_index(a.head_map, n_v, n_k)])
    qv, kv = e.fresh(f"{out}/q_heads"), e.fresh(f"{out}/k_heads")
    e.emit("Gather", [q, kmap], [qv], axis=1)
    e.emit("Gather", [k, kmap], [kv], axis=1)
    body = _delta_step(a.scale, a.key_decay)
    e.emit("Scan", [state, qv, kv, v, g, beta], [new_state, out], body=body, num_scan_inputs=5)


def _delta_step(scale: float, key_decay: bool = False) -> GraphProto:
    """Scan body: (m, q [Hv,Dk], k [Hv,Dk], v [Hv,Dv], g [Hv] (key_decay: [Hv,Dk]), beta [Hv]) -> (m', o [Hv,Dv])."""

    def n(op: str, ins: list[str], outs: list[str]) -> NodeProto:
        return helper.make_node(op, [f"step.{i}" for i in ins], [f"step.{o}" for o in outs])

    consts = {"ax0": [1] if key_decay else [1, 2], "ax1": [1], "ax2": [2]}  # exp(g) along M's key axis
    inits = [numpy_helper.from_array(np.asarray(v, np.int64), f"step.{k}") for k, v in consts.items()]
    inits.append(numpy_helper.from_array(np.asarray(scale, np.float32), "step.scale"))
    nodes = [
        n("Exp", ["g"], ["eg"]), n("Unsqueeze", ["eg", "ax0"], ["eg3"]), n("Mul", ["m", "eg3"], ["m1"]),
        n("Unsqueeze", ["k", "ax2"], ["kcol"]), n("MatMul", ["m1", "kcol"], ["mk3"]),
        n("Squeeze", ["mk3", "ax2"], ["mk"]), n("Sub", ["v", "mk"], ["err"]),
        n("Unsqueeze", ["beta", "ax1"], ["beta2"]), n("Mul", ["err", "beta2"], ["d"]),
        n("Unsqueeze", ["d", "ax2"], ["dcol"]), n("Unsqueeze", ["k", "ax1"], ["krow"]),
        n("Mul", ["dcol", "krow"], ["outer"]), n("Add", ["m1", "outer"], ["m_next"]),
        n("Unsqueeze", ["q", "ax2"], ["qcol"]), n("MatMul", ["m_next", "qcol"], ["mq3"]),
        n("Squeeze", ["mq3", "ax2"], ["mq"]), n("Mul", ["mq", "scale"], ["o"]),
    ]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(f"step.{x}", f, None) for x in ("m", "q", "k", "v", "g", "beta")]
    outs = [helper.make_tensor_value_info(f"step.{x}", f, None) for x in ("m_next", "o")]
    return helper.make_graph(nodes, "gated_delta_step", ins, outs, inits)


def spell_lightning_attention(e: OnnxWriter, node: Node) -> None:
    """A Scan over tokens carrying S [H, Dk, Dv]: the recurrence the block form computes,
    S = e^(-s*slope) S + k v^T, o = q S (lightning_attention_ref up to rounding)."""
    state, q, k, v = (e.name(i) for i in node.inputs)
    new_state, out = (e.name(o) for o in node.outputs)
    a: LightningAttention = node.attrs
    lam = np.exp(-np.asarray(a.slopes, np.float64) * a.layer_scale).astype(np.float32)
    e.emit("Scan", [state, q, k, v], [new_state, out], body=_lightning_step(lam), num_scan_inputs=3)


def _lightning_step(decay: np.ndarray) -> GraphProto:
    """Scan body: (s [H,Dk,Dv], q [H,Dk], k [H,Dk], v [H,Dv]) -> (s', o [H,Dv])."""

    def n(op: str, ins: list[str], outs: list[str]) -> NodeProto:
        return helper.make_node(op, [f"lstep.{i}" for i in ins], [f"lstep.{o}" for o in outs])

    axes = {"ax1": [1], "ax2": [2]}
    inits = [numpy_helper.from_array(np.asarray(v, np.int64), f"lstep.{k}") for k, v in axes.items()]
    inits.append(numpy_helper.from_array(decay.reshape(-1, 1, 1), "lstep.decay"))
    nodes = [
        n("Mul", ["s", "decay"], ["s1"]), n("Unsqueeze", ["k", "ax2"], ["kcol"]),
        n("Unsqueeze", ["v", "ax1"], ["vrow"]), n("Mul", ["kcol", "vrow"], ["outer"]),
        n("Add", ["s1", "outer"], ["s_next"]), n("Unsqueeze", ["q", "ax1"], ["qrow"]),
        n("MatMul", ["qrow", "s_next"], ["o3"]), n("Squeeze", ["o3", "ax1"], ["o"]),
    ]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(f"lstep.{x}", f, None) for x in ("s", "q", "k", "v")]
    outs = [helper.make_tensor_value_info(f"lstep.{x}", f, None) for x in ("s_next", "o")]
    return helper.make_graph(nodes, "lightning_step", ins, outs, inits)


def _cells(e: OnnxWriter, out: str) -> tuple[str, str]:
    """Cell ids j [P+T] and query positions q [T, 1] (int64), for the masks over the context."""
    s = e.symbols
    cells = _range(e, e.const(f"{out}/zero", np.asarray(0, np.int64)), s.scalar("P+T"), f"{out}/cells")
    rows = _unsqueeze(e, _range(e, s.scalar("P"), s.scalar("P+T"), f"{out}/rows"), [1], f"{out}/rows_col")
    return cells, rows


def _where(e: OnnxWriter, cond: str, a: str, b: str, base: str) -> str:
    out = e.fresh(base)
    e.emit("Where", [cond, a, b], [out])
    return out


def _constants(e: OnnxWriter, base: str, dtype: type) -> Callable[[str, int], str]:
    """A maker of named scalar constants of one integer type under `base`."""

    def make(name: str, value: int) -> str:
        return e.const(f"{base}/{name}", np.asarray(value, dtype))

    return make


def _op(e: OnnxWriter, op: str, ins: list[str], base: str, **attrs: Any) -> str:
    out = e.fresh(base)
    e.emit(op, ins, [out], **attrs)
    return out


def spell_index_mask(e: OnnxWriter, node: Node) -> None:
    """[T, P+T]: 0 at the selected cells j <= P + i, -inf elsewhere (ids of -1 select nothing)."""
    out = e.name(node.outputs[0])
    cells, rows = _cells(e, out)
    sel = _unsqueeze(e, _op(e, "Cast", [e.name(node.inputs[0])], f"{out}/sel64", to=TensorProto.INT64), [2],
                     f"{out}/sel_col")  # [T, W, 1]
    hit = _op(e, "Cast", [_op(e, "Equal", [sel, cells], f"{out}/hit")], f"{out}/hit_f", to=TensorProto.FLOAT)
    chosen = _op(e, "ReduceMax", [hit, e.ints(f"{out}/w_axis", [1])], f"{out}/chosen_f", keepdims=0)
    chosen = _op(e, "Cast", [chosen], f"{out}/chosen", to=TensorProto.BOOL)
    keep = _op(e, "And", [chosen, _op(e, "LessOrEqual", [cells, rows], f"{out}/seen")], f"{out}/keep")
    zero, ninf = (e.const(f"{out}/{k}", np.asarray(v, np.float32)) for k, v in (("zero_f", 0.0), ("ninf", -np.inf)))
    e.emit("Where", [keep, zero, ninf], [out])


def spell_indexer_topk(e: OnnxWriter, node: Node) -> None:
    """Per-cell values as `cell_values` (block score, the tail bias, -inf past the query), then the
    min(width, P+T) cells llama.cpp's heap keeps (ties included, in its order), -1 for unseen cells,
    padded with -1 to width."""
    a: IndexerTopK = node.attrs
    out, r = e.name(node.outputs[0]), a.ratio
    scores = e.name(node.inputs[0])
    last = int(node.inputs[0].shape[1]) - 1  # the tail's column
    s = e.symbols
    cells, rows = _cells(e, out)
    i64 = _constants(e, out, np.int64)
    block = _op(e, "Div", [cells, i64("r", r)], f"{out}/block")  # j // r (j >= 0)
    n_full = _op(e, "Min", [_op(e, "Div", [s.scalar("P+T"), i64("r2", r)], f"{out}/n_blocks"), i64("last", last)],
                 f"{out}/n_full")
    block_score = _op(e, "Gather", [scores, _op(e, "Min", [block, i64("last2", last)], f"{out}/col")],
                      f"{out}/block_score", axis=1)  # [T, P+T]
    tail_start = _op(e, "Mul", [_op(e, "Div", [_op(e, "Add", [rows, i64("one", 1)], f"{out}/q1"), i64("r3", r)],
                                    f"{out}/q1_blocks"), i64("r4", r)], f"{out}/tail_start")  # [T, 1]
    in_tail = _op(e, "GreaterOrEqual", [_op(e, "Mul", [block, i64("r5", r)], f"{out}/block_start"), tail_start],
                  f"{out}/in_tail")
    bias = e.const(f"{out}/tail_bias", np.asarray(1e9, np.float32))
    zero, ninf = (e.const(f"{out}/{k}", np.asarray(v, np.float32)) for k, v in (("zero_f", 0.0), ("ninf", -np.inf)))
    full_value = _op(e, "Add", [block_score, _where(e, in_tail, bias, zero, f"{out}/bias")], f"{out}/full_value")
    tail_col = _op(e, "Slice", [scores, e.ints(f"{out}/t0", [last]), e.ints(f"{out}/t1", [last + 1]),
                                e.ints(f"{out}/t_axis", [1])], f"{out}/tail_col")
    tail_value = _op(e, "Add", [tail_col, bias], f"{out}/tail_value")  # [T, 1]
    value = _where(e, _op(e, "Less", [block, n_full], f"{out}/whole"), full_value, tail_value, f"{out}/value")
    value = _where(e, _op(e, "LessOrEqual", [cells, rows], f"{out}/seen"), value, ninf, f"{out}/cell_values")
    _heap_ids(e, out, value, ninf, a.width)


def spell_token_topk(e: OnnxWriter, node: Node) -> None:
    """DSA: the score row with -inf past the query, then the min(width, P+T) cells llama.cpp's heap
    keeps (ties included, in its order), -1 for unseen cells, padded with -1 to width."""
    a: TokenTopK = node.attrs
    out = e.name(node.outputs[0])
    cells, rows = _cells(e, out)
    ninf = e.const(f"{out}/ninf", np.asarray(-np.inf, np.float32))
    value = _where(e, _op(e, "LessOrEqual", [cells, rows], f"{out}/seen"), e.name(node.inputs[0]), ninf,
                   f"{out}/cell_values")
    _heap_ids(e, out, value, ninf, a.width)


def _heap_ids(e: OnnxWriter, out: str, value: str, ninf: str, width: int) -> None:
    """`out` [T, width] int32: the heap select of the [T, P+T] cell values (-1: unseen or padding)."""
    s = e.symbols
    k = _op(e, "Min", [e.ints(f"{out}/width", [width]), s.tensor("P+T")], f"{out}/k")
    heap = Body(f"{out}/heap")
    k_scalar = heap.op("Squeeze", [k, heap.const([0])])
    chosen = heap_select(heap, value, s.tensor("T"), k_scalar, s.scalar("P+T"), f"{out}/heap")
    e.nodes += heap.nodes
    e.inits += heap.inits
    top_v = _op(e, "GatherElements", [value, chosen], f"{out}/top_values", axis=1)
    none = e.const(f"{out}/none", np.asarray(-1, np.int64))
    ids = _where(e, _op(e, "Equal", [top_v, ninf], f"{out}/unseen"), none, chosen, f"{out}/ids")
    pads = _op(e, "Concat", [e.ints(f"{out}/pad0", [0, 0, 0]),
                             _op(e, "Sub", [e.ints(f"{out}/width2", [width]), k], f"{out}/pad")],
               f"{out}/pads", axis=0)
    padded = _op(e, "Pad", [ids, pads, none], f"{out}/padded")
    e.emit("Cast", [padded], [out], to=TensorProto.INT32)


def spell_head_matmul(e: OnnxWriter, node: Node) -> None:
    """x [T,H,K], w [H,N,K] -> [T,H,N]: one batched MatMul over heads."""
    x, w = (e.name(v) for v in node.inputs)
    out = e.name(node.outputs[0])
    xh = _op(e, "Transpose", [x], f"{out}/x_heads", perm=[1, 0, 2])  # [H, T, K]
    wt = _op(e, "Transpose", [w], f"{out}/w_t", perm=[0, 2, 1])  # [H, K, N]
    e.emit("Transpose", [_op(e, "MatMul", [xh, wt], f"{out}/heads")], [out], perm=[1, 0, 2])


def spell_block_mask(e: OnnxWriter, node: Node) -> None:
    """[G, T, P+T]: 0 at cells of the selected blocks up to the query, -inf elsewhere."""
    out, block = e.name(node.outputs[0]), node.attrs.block
    cells, rows = _cells(e, out)
    of_cell = _op(e, "Div", [cells, e.const(f"{out}/block", np.asarray(block, np.int64))], f"{out}/of_cell")
    sel = _unsqueeze(e, _op(e, "Cast", [e.name(node.inputs[0])], f"{out}/sel64", to=TensorProto.INT64), [3],
                     f"{out}/sel_col")  # [T, G, K, 1]
    hit = _op(e, "Cast", [_op(e, "Equal", [sel, of_cell], f"{out}/hit")], f"{out}/hit_f", to=TensorProto.FLOAT)
    chosen = _op(e, "ReduceMax", [hit, e.ints(f"{out}/k_axis", [2])], f"{out}/chosen_f", keepdims=0)
    chosen = _op(e, "Cast", [chosen], f"{out}/chosen", to=TensorProto.BOOL)  # [T, G, P+T]
    seen = _unsqueeze(e, _op(e, "LessOrEqual", [cells, rows], f"{out}/seen"), [1], f"{out}/seen3")
    keep = _op(e, "And", [chosen, seen], f"{out}/keep")
    zero, ninf = (e.const(f"{out}/{k}", np.asarray(v, np.float32)) for k, v in (("zero_f", 0.0), ("ninf", -np.inf)))
    e.emit("Transpose", [_where(e, keep, zero, ninf, f"{out}/tgc")], [out], perm=[1, 0, 2])


LOCAL_VALUE = 1e30  # above any block score: the local blocks are taken first, the nearest first


def spell_block_topk(e: OnnxWriter, node: Node) -> None:
    """`block_topk_ref` as one TopK: the local blocks valued LOCAL_VALUE * (1 + b / NB) (nearest
    first), earlier blocks their score, later ones -inf; TopK's order (descending, ties to the lower
    index) is the reference's; -1 where the value is -inf."""
    a: BlockTopK = node.attrs
    out, scores = e.name(node.outputs[0]), e.name(node.inputs[0])
    nb = int(node.inputs[0].shape[2])
    width = min(a.top_k, nb)
    s = e.symbols
    i64 = _constants(e, out, np.int64)
    positions = _range(e, s.scalar("P"), s.scalar("P+T"), f"{out}/positions")
    last = _unsqueeze(e, _op(e, "Div", [positions, i64("block", a.block)], f"{out}/last"), [1, 2], f"{out}/last3")
    n_local = _op(e, "Min", [_op(e, "Min", [i64("local", a.local), _op(e, "Add", [last, i64("one", 1)],
                                                                          f"{out}/upto")], f"{out}/n_local0"),
                             i64("width", width)], f"{out}/n_local")
    blocks = _range(e, i64("zero", 0), i64("nb", nb), f"{out}/blocks")
    visible = _op(e, "LessOrEqual", [blocks, last], f"{out}/visible")  # [T, 1, NB]
    local = _op(e, "And", [visible, _op(e, "Greater", [blocks, _op(e, "Sub", [last, n_local], f"{out}/first_local")],
                                        f"{out}/late")], f"{out}/local")
    blocks_f = _op(e, "Cast", [blocks], f"{out}/blocks_f", to=TensorProto.FLOAT)
    local_value = _op(e, "Mul", [_op(e, "Add", [_op(e, "Div", [blocks_f, e.const(f"{out}/nb_f", np.asarray(
        nb, np.float32))], f"{out}/frac"), e.const(f"{out}/one_f", np.asarray(1.0, np.float32))], f"{out}/rank"),
        e.const(f"{out}/local_value", np.asarray(LOCAL_VALUE, np.float32))], f"{out}/local_values")
    ninf = e.const(f"{out}/ninf", np.asarray(-np.inf, np.float32))
    value = _where(e, local, local_value, _where(e, visible, scores, ninf, f"{out}/earlier"), f"{out}/value")
    top_v, top_i = e.fresh(f"{out}/top_values"), e.fresh(f"{out}/top_ids")
    e.emit("TopK", [value, e.ints(f"{out}/k", [width])], [top_v, top_i], axis=2, largest=1, sorted=1)
    ids = _where(e, _op(e, "Equal", [top_v, ninf], f"{out}/empty"), i64("none", -1), top_i, f"{out}/ids")
    e.emit("Cast", [ids], [out], to=TensorProto.INT32)


def spell_ple_hash(e: OnnxWriter, node: Node) -> None:
    """The n-gram contexts from the token history (EOS from the first cut on), then per n-gram the
    XOR of token * multiplier (uint64, wrapping) and per head `mixed % size + offset`."""
    a: PleHash = node.attrs
    hist, tokens, _ = (e.name(v) for v in node.inputs)
    out, s = e.name(node.outputs[0]), e.symbols
    u64, i64 = _constants(e, out, np.uint64), _constants(e, out, np.int64)
    positions = _range(e, s.scalar("P"), s.scalar("P+T"), f"{out}/positions")
    eos = i64("eos", a.eos)
    context = [_op(e, "Cast", [tokens], f"{out}/ctx0", to=TensorProto.INT64)]
    cut: str | None = None
    for back in range(1, a.ngram):
        at = _op(e, "Sub", [positions, i64(f"back{back}", back)], f"{out}/at{back}")
        before_start = _op(e, "Less", [at, i64(f"zero{back}", 0)], f"{out}/before{back}")
        clamped = _op(e, "Max", [at, i64(f"zero_b{back}", 0)], f"{out}/clamped{back}")
        tok = _op(e, "Cast", [_op(e, "Gather", [hist, clamped], f"{out}/hist{back}", axis=0)], f"{out}/tok{back}",
                  to=TensorProto.INT64)
        stop = _op(e, "Or", [before_start, _op(e, "Or", [_op(e, "Less", [tok, i64(f"z{back}", 0)], f"{out}/neg{back}"),
                                                         _op(e, "Equal", [tok, eos], f"{out}/eos{back}")],
                                                f"{out}/bad{back}")], f"{out}/stop{back}")
        cut = stop if cut is None else _op(e, "Or", [cut, stop], f"{out}/cut{back}")
        context.append(_where(e, cut, eos, tok, f"{out}/ctx{back}"))
    terms = [_op(e, "Mul", [_op(e, "Cast", [c], f"{out}/ctx{j}_u64", to=TensorProto.UINT64),
                            u64(f"mult{j}", a.multipliers[j])], f"{out}/term{j}")
             for j, c in enumerate(context)]
    heads = []
    mixed = terms[0]
    for g in range(2, a.ngram + 1):
        mixed = _op(e, "BitwiseXor", [mixed, terms[g - 1]], f"{out}/mixed{g}")
        for kk in range(a.heads_per_ngram):
            h = (g - 2) * a.heads_per_ngram + kk
            row = _op(e, "Add", [_op(e, "Mod", [mixed, u64(f"size{h}", a.sizes[h])], f"{out}/mod{h}"),
                                 u64(f"offset{h}", a.offsets[h])], f"{out}/row{h}")
            heads.append(_unsqueeze(e, row, [1], f"{out}/row{h}_col"))
    rows = _op(e, "Concat", heads, f"{out}/rows_u64", axis=1) if len(heads) > 1 else heads[0]
    e.emit("Cast", [rows], [out], to=TensorProto.INT32)


def _complete_rows(e: OnnxWriter, out: str, n_rows: int, ratio: int) -> str:
    """[T, NB] bool: compressed row j is complete for query i ((j + 1) * ratio <= P + i + 1)."""
    _, rows = _cells(e, out)
    last_cells = e.const(f"{out}/row_last_cell", ((np.arange(n_rows) + 1) * ratio - 1).astype(np.int64))
    return _op(e, "LessOrEqual", [last_cells, rows], f"{out}/complete")


def spell_compressed_score(e: OnnxWriter, node: Node) -> None:
    """[T, NB]: sum over heads of w * relu(q . row) (one batched MatMul), -inf at rows not complete."""
    q, w, rows = (e.name(v) for v in node.inputs[:3])
    out, n_rows = e.name(node.outputs[0]), int(node.inputs[2].shape[0])
    dots = _op(e, "Relu", [_op(e, "MatMul", [q, _op(e, "Transpose", [rows], f"{out}/rows_t")], f"{out}/dots")],
               f"{out}/relu")  # [T, Hi, NB]
    weighted = _op(e, "Mul", [dots, _unsqueeze(e, w, [2], f"{out}/w_col")], f"{out}/weighted")
    total = _op(e, "ReduceSum", [weighted, e.ints(f"{out}/h_axis", [1])], f"{out}/total", keepdims=0)
    ninf = e.const(f"{out}/ninf", np.asarray(-np.inf, np.float32))
    e.emit("Where", [_complete_rows(e, out, n_rows, node.attrs.ratio), total, ninf], [out])


def spell_compressed_attention(e: OnnxWriter, node: Node) -> None:
    """One softmax over [raw cells of the window | compressed rows (all, or the selected ones,
    gathered per query) | the head's sink]; the sink column carries no value."""
    a: CompressedAttention = node.attrs
    q, cache = e.name(node.inputs[0]), e.name(node.inputs[1])
    out, s = e.name(node.outputs[0]), e.symbols
    ninf = e.const(f"{out}/ninf", np.asarray(-np.inf, np.float32))
    scale = e.const(f"{out}/scale", np.asarray(a.scale, np.float32))
    keys = _slice(e, cache, e.ints(f"{out}/zero", [0]), s.tensor("P+T"), 0, f"{out}/keys")  # [P+T, D]
    cells, qrows = _cells(e, out)
    ago = _op(e, "Sub", [qrows, cells], f"{out}/ago")
    seen = _op(e, "And", [_op(e, "LessOrEqual", [cells, qrows], f"{out}/causal"),
                          _op(e, "Less", [ago, e.const(f"{out}/window", np.asarray(a.window, np.int64))],
                              f"{out}/in_window")], f"{out}/seen")
    raw = _op(e, "Mul", [_op(e, "MatMul", [q, _op(e, "Transpose", [keys], f"{out}/keys_t")], f"{out}/raw_dot"),
                         scale], f"{out}/raw_scaled")  # [T, H, P+T]
    logits = [_where(e, _unsqueeze(e, seen, [1], f"{out}/seen3"), raw, ninf, f"{out}/raw")]
    extra = _compressed_columns(e, node, out, q, scale, ninf) if a.ratio else None
    if extra is not None:
        logits.append(extra[0])
    n_head = int(node.inputs[0].shape[1])
    sink_shape = _op(e, "Concat", [s.tensor("T"), e.ints(f"{out}/h1", [n_head, 1])], f"{out}/sink_shape", axis=0)
    sinks = _unsqueeze(e, e.name(node.inputs[2]), [0, 2], f"{out}/sinks3")
    logits.append(_op(e, "Expand", [sinks, sink_shape], f"{out}/sink_col"))  # [T, H, 1]
    probs = _op(e, "Softmax", [_op(e, "Concat", logits, f"{out}/logits", axis=2)], f"{out}/probs", axis=2)
    raw_probs = _slice(e, probs, e.ints(f"{out}/zero2", [0]), s.tensor("P+T"), 2, f"{out}/raw_probs")
    acc = _op(e, "MatMul", [raw_probs, keys], f"{out}/acc_raw")
    if extra is None:
        e.emit("Identity", [acc], [out])
        return
    _, values, width = extra
    end = _op(e, "Add", [s.tensor("P+T"), e.ints(f"{out}/width", [width])], f"{out}/extra_end")
    extra_probs = _slice(e, probs, s.tensor("P+T"), end, 2, f"{out}/extra_probs")
    e.emit("Add", [acc, _op(e, "MatMul", [extra_probs, values], f"{out}/acc_extra")], [out])


def _compressed_columns(e: OnnxWriter, node: Node, out: str, q: str, scale: str, ninf: str
                        ) -> tuple[str, str, int]:
    """(logits [T, H, W] of the compressed rows, their values ([NB, D], or [T, k, D] gathered per
    query), W): every complete row, or the selected ones (-1 and incomplete rows masked)."""
    a: CompressedAttention = node.attrs
    rows = e.name(node.inputs[4])
    n_rows = int(node.inputs[4].shape[0])
    complete = _complete_rows(e, out, n_rows, a.ratio)  # [T, NB]
    if a.selected:
        sel = _op(e, "Cast", [e.name(node.inputs[5])], f"{out}/sel64", to=TensorProto.INT64)  # [T, k]
        clamped = _op(e, "Max", [_op(e, "Min", [sel, e.const(f"{out}/last_row", np.asarray(n_rows - 1, np.int64))],
                                     f"{out}/sel_min"), e.const(f"{out}/zero_i", np.asarray(0, np.int64))],
                      f"{out}/sel_row")
        values = _op(e, "Gather", [rows, clamped], f"{out}/sel_rows", axis=0)  # [T, k, D]
        ok = _op(e, "And", [_op(e, "GreaterOrEqual", [sel, e.const(f"{out}/zero_s", np.asarray(0, np.int64))],
                                f"{out}/listed"),
                            _op(e, "GatherElements", [complete, clamped], f"{out}/sel_complete", axis=1)],
                 f"{out}/sel_ok")
        dots = _op(e, "MatMul", [q, _op(e, "Transpose", [values], f"{out}/sel_rows_t", perm=[0, 2, 1])],
                   f"{out}/extra_dot")  # [T, H, k]
        width = int(node.inputs[5].shape[1])
    else:
        values, ok, width = rows, complete, n_rows
        dots = _op(e, "MatMul", [q, _op(e, "Transpose", [rows], f"{out}/rows_t")], f"{out}/extra_dot")
    scaled = _op(e, "Mul", [dots, scale], f"{out}/extra_scaled")
    return _where(e, _unsqueeze(e, ok, [1], f"{out}/ok3"), scaled, ninf, f"{out}/extra"), values, width


SPELLED: dict[str, Callable[[OnnxWriter, Node], None]] = {
    "positions": spell_positions,
    "causal_mask": spell_causal_mask,
    "window_mask": spell_window_mask,
    "cache_write": spell_cache_write,
    "cache_read": spell_cache_read,
    "matmul_id": spell_matmul_id,
    "ssm_conv": spell_ssm_conv,
    "gated_delta_net": spell_gated_delta_net,
    "lightning_attention": spell_lightning_attention,
    "indexer_topk": spell_indexer_topk,
    "token_topk": spell_token_topk,
    "head_matmul": spell_head_matmul,
    "index_mask": spell_index_mask,
    "block_topk": spell_block_topk,
    "block_mask": spell_block_mask,
    "ple_hash": spell_ple_hash,
    "compressed_score": spell_compressed_score,
    "compressed_attention": spell_compressed_attention,
}
