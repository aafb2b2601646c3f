"""deepseek4 (llama.cpp `src/models/deepseek4.cpp`, cache `llama-kv-cache-dsv4.cpp`;
docs/arch/deepseek-glm-minimax-kimi-hy.md §1).

* the residual is `hc` streams wide; before each attention and each FFN a full-rank mix of the
  RMS-normalised streams gives pre weights (the block input), post weights and a Sinkhorn-normalised
  hc x hc comb matrix that mixes the old streams when the block output is written back; a final
  pre-only mix collapses the streams before the output norm;
* attention: q from the low-rank q_a/q_b with a weightless per-head RMSNorm, one shared K = V head
  (`attn_kv`, normed), rope (NORM) on the last R dims of each head, attention sinks, the output
  rotated back and projected per group (`attn_output_a`) then by `attn_output_b`;
  per layer `compress_ratios`: 0 = sliding-window attention over raw tokens; 4 = CSA, the window
  plus compressed rows (each complete block of 4 pooled over an overlapping window of 8), only
  the top `indexer.top_k` of them by the lightning indexer (its own compressed keys); 128 = HCA,
  the window plus every complete compressed row. Compressed layers rope with
  `compress_rope_freq_base` (and YaRN when configured);
* MoE: sqrt(softplus) router, selection by scores plus `exp_probs_b`, weights from the unbiased
  scores (normalised, scaled), SwiGLU clamped by `swiglu_clamp_exp`, plus a
  shared expert clamped by `swiglu_clamp_shexp`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ggufc.ir import moe_routing_spelled as MS
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder, rms_norm_plain
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from .. import hyper_connections as HC
from ..hparams import Keys, ModelError, rope_freq_scale
from ..sparse_indexers import compressed_rows as C

ARCH = "deepseek4"


@dataclasses.dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_layer_all: int
    n_head: int
    head_dim: int
    n_rot: int
    eps: float
    q_rank: int
    window: int
    rope_base: float
    compress_base: float
    yarn: C.YarnParams | None
    ratios: tuple[int, ...]
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_shared: int
    weights_scale: float
    weights_norm: bool
    clamp_exp: tuple[float, ...]
    clamp_shexp: tuple[float, ...]
    hash_layers: int
    idx_heads: int
    idx_dim: int
    idx_top_k: int
    out_groups: int
    out_rank: int
    n_hc: int
    sinkhorn_iters: int
    hc_eps: float

    @property
    def n_head_kv(self) -> int:  # one K = V head shared by every query head
        return 1


def _per_layer_floats(keys: Keys, name: str, n: int, default: list[float] | None = None) -> tuple[float, ...]:
    v = keys.raw(name)
    if v is None:
        if default is None:
            raise ModelError(f"missing required key deepseek4.{name}")
        return tuple(default)
    vals = [float(x) for x in v] if isinstance(v, list) else [float(v)] * n
    if len(vals) < n:
        raise ModelError(f"key deepseek4.{name} has {len(vals)} entries, expected {n}")
    return tuple(vals[:n])


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_all = keys.int("block_count")
    n_layer = n_all - keys.int("nextn_predict_layers", 0)
    D, Dv = keys.int("attention.key_length"), keys.int("attention.value_length")
    if keys.int("attention.head_count_kv") != 1 or D != Dv:
        raise ModelError("deepseek4 needs head_count_kv 1 and key_length == value_length")
    if keys.int("expert_gating_func") != 4:
        raise ModelError("deepseek4 needs expert_gating_func 4 (sqrt-softplus)")
    n_hc = keys.int("hyper_connection.count")
    if n_hc != 4 or keys.int("hyper_connection.sinkhorn_iterations") < 1:
        raise ModelError("deepseek4 needs hyper_connection.count 4 and at least one Sinkhorn iteration")
    ratios_raw = keys.raw("attention.compress_ratios")
    if not isinstance(ratios_raw, list) or len(ratios_raw) < n_layer:
        raise ModelError(f"deepseek4.attention.compress_ratios needs one entry per layer ({n_layer})")
    ratios = tuple(int(r) for r in ratios_raw[:n_layer])
    for il, r in enumerate(ratios):
        C.check_ratio(r, il)
    H, R = keys.int("attention.head_count"), keys.int("rope.dimension_count")
    G, Di = keys.int("attention.output_group_count"), keys.int("attention.indexer.key_length")
    if R % 2 or R > D or (4 in ratios and R > Di) or H % G:
        raise ModelError(f"deepseek4: rope dims {R}, head dim {D}, indexer dim {Di}, groups {G} of {H} heads disagree")
    hash_layers = keys.int("hash_layer_count", 0)
    if not 0 <= hash_layers <= n_layer:
        raise ModelError(f"deepseek4: hash_layer_count {hash_layers} is not in [0, {n_layer}]")
    clamp = _per_layer_floats(keys, "swiglu_clamp_exp", n_all)
    return HParams(
        n_vocab=n_vocab, n_ctx_train=keys.int("context_length"), n_embd=keys.int("embedding_length"),
        n_layer=n_layer, n_layer_all=n_all, n_head=H,
        head_dim=D, n_rot=R, eps=keys.float("attention.layer_norm_rms_epsilon"),
        q_rank=keys.int("attention.q_lora_rank"), window=keys.int("attention.sliding_window"),
        rope_base=keys.float("rope.freq_base", 10000.0),
        compress_base=keys.float("attention.compress_rope_freq_base"), yarn=_yarn(keys), ratios=ratios,
        n_expert=keys.int("expert_count"), n_expert_used=keys.int("expert_used_count"),
        n_ff_exp=keys.int("expert_feed_forward_length"), n_shared=keys.int("expert_shared_count"),
        weights_scale=keys.float("expert_weights_scale"), weights_norm=bool(keys.raw("expert_weights_norm")),
        clamp_exp=clamp, clamp_shexp=_per_layer_floats(keys, "swiglu_clamp_shexp", n_all, list(clamp)),
        hash_layers=hash_layers, idx_heads=keys.int("attention.indexer.head_count"), idx_dim=Di,
        idx_top_k=keys.int("attention.indexer.top_k"), out_groups=G, out_rank=keys.int("attention.output_lora_rank"),
        n_hc=n_hc, sinkhorn_iters=keys.int("hyper_connection.sinkhorn_iterations"),
        hc_eps=keys.float("hyper_connection.epsilon"),
    )


def _yarn(keys: Keys) -> C.YarnParams | None:
    """The compressed layers' rope scaling (llama-context.cpp's cparams); None: plain rope."""
    fs = rope_freq_scale(keys)
    if keys.raw("rope.scaling.type", "linear") != "yarn":
        return None if fs == 1.0 else C.YarnParams(fs, 0.0, 0, 1.0)
    n_orig = keys.int("rope.scaling.original_context_length", 0) or keys.int("context_length")
    af = 1.0 / (1.0 + 0.1 * math.log(1.0 / fs)) if fs != 1.0 else 1.0  # the net cos/sin magnitude is 1
    return C.YarnParams(fs, 1.0, n_orig, af)


@dataclasses.dataclass(frozen=True)
class _Tables:
    """Per rope kind (0: ratio-0 layers, 1: compressed layers): the forward and inverse tables and
    the angles of the block starts per ratio."""

    fwd: dict[int, Value]
    inv: dict[int, Value]
    raw: dict[int, np.ndarray]


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    E, hc = hp.n_embd, hp.n_hc
    n_pos = _cells(n_ctx, max(hp.ratios + (1,)))
    raw = {0: C.yarn_table(n_pos, hp.n_rot, hp.rope_base, None),
           1: C.yarn_table(n_pos, hp.n_rot, hp.compress_base, hp.yarn)}
    kinds = sorted({int(r > 0) for r in hp.ratios})
    fwd = {k: w.add_derived(f"rope_table.{k}", raw[k]) for k in kinds}
    inv = {k: w.add_derived(f"rope_table_inv.{k}", C.inverse_table(raw[k])) for k in kinds}
    tables = _Tables(fwd, inv, raw)
    inp = B.decoder_inputs(w, hp.n_vocab, E, lambda: fwd[kinds[0]])
    x3 = b.reshape(inp.x, (inp.x.shape[0], 1, E), "hc_init1")
    streams = b.emit("concat", [x3] * hc, O.Concat(1), "hc_init")
    new_state: dict[str, Value] = {}

    def mix(prefix: str, collapse: bool = False) -> HC.SinkhornMix:
        return HC.sinkhorn_weights(w, prefix, hc, E, hp.hc_eps, hp.sinkhorn_iters, collapse)

    def layer(il: int, streams: Value) -> Value:
        p = f"blk.{il}"
        h, post, comb = HC.sinkhorn_pre(b, streams, mix(f"{p}.hc_attn"), hp.eps, "hc_attn_pre")
        y = _attention(b, w, hp, il, h, inp.pos, tables, n_ctx, new_state)
        streams = HC.hc_post_comb(b, streams, y, post, comb, "hc_attn_post")
        h, post, comb = HC.sinkhorn_pre(b, streams, mix(f"{p}.hc_ffn"), hp.eps, "hc_ffn_pre")
        z = B.rms_norm(b, h, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
        y = b.add(_moe(b, w, hp, il, z, inp.tokens), _shared_expert(b, w, hp, il, z), "ffn_out")
        return HC.hc_post_comb(b, streams, y, post, comb, "l_out")

    streams = B.layers(b, hp.n_layer, streams, layer)
    prefixes = tuple(f"blk.{il}." for il in range(hp.n_layer, hp.n_layer_all))  # MTP blocks: not run here
    w.used.update(n for n in w.model.tensors if prefixes and n.startswith(prefixes))

    def head(streams: Value) -> Value:
        collapsed = HC.sinkhorn_collapse(b, streams, mix("output_hc", collapse=True), hp.eps, "hc_out")
        return B.rms_norm(b, collapsed, w.need("output_norm.weight", (E,)), hp.eps, "result_norm")

    return B.output_head(w, inp, streams, all_logits, new_state, head)


def _cells(n_ctx: int, ratio: int) -> int:
    return -(-n_ctx // ratio) * ratio


def _attention(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, pos: Value, tables: _Tables, n_ctx: int,
               new_state: dict[str, Value]) -> Value:
    E, H, D, R, Q = hp.n_embd, hp.n_head, hp.head_dim, hp.n_rot, hp.q_rank
    p = f"blk.{il}"
    ratio = hp.ratios[il]
    kind = int(ratio > 0)
    x = B.rms_norm(b, h, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    qr = B.rms_norm(b, b.matmul(x, w.need(f"{p}.attn_q_a.weight", (Q, E)), "q_a"),
                    w.need(f"{p}.attn_q_a_norm.weight", (Q,)), hp.eps, "qr")
    q = B.heads(b, b.matmul(qr, w.need(f"{p}.attn_q_b.weight", (H * D, Q)), "q_b"), H, D, "q_heads")
    q = C.rope_tail(b, rms_norm_plain(b, q, hp.eps, "q_normed"), pos, tables.fwd[kind], R, "Qcur")
    kv = B.rms_norm(b, b.matmul(x, w.need(f"{p}.attn_kv.weight", (D, E)), "kv_proj"),
                    w.need(f"{p}.attn_kv_a_norm.weight", (D,)), hp.eps, "kv_normed")
    kv = C.rope_tail(b, b.reshape(kv, (kv.shape[0], 1, D), "kv3"), pos, tables.fwd[kind], R, "kv_roped")
    cache = b.emit("cache_write", [b.state(f"cache_kv.{il}", (n_ctx, D)), b.reshape(kv, (kv.shape[0], D), "KVcur"),
                                   pos], O.NoAttrs(), f"cache_kv.{il}")
    new_state[f"cache_kv.{il}"] = cache
    sinks = w.get(f"{p}.attn_sinks.weight", (H,), f32=True)
    assert sinks is not None
    scale = 1.0 / math.sqrt(D)
    if ratio == 0:
        o = C.attend(b, q, cache, sinks, pos, scale, hp.window)
    else:
        cells = _cells(n_ctx, ratio)
        starts = tables.raw[1][: cells : ratio]
        comp = C.Compressor(f"{p}.attn_compressor", f"comp.{il}", D, ratio, cells)
        rows = C.compressed_rows(b, w, comp, x, pos, hp.eps, starts, new_state)
        sel = _indexer(b, w, hp, il, x, qr, pos, tables, cells, starts, new_state) if ratio == 4 else None
        o = C.attend(b, q, cache, sinks, pos, scale, hp.window, rows, ratio, sel)
    o = C.rope_tail(b, o, pos, tables.inv[kind], R, "kqv_derope")
    return _grouped_output(b, w, hp, il, o)


def _indexer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, qr: Value, pos: Value, tables: _Tables,
             cells: int, starts: np.ndarray, new_state: dict[str, Value]) -> Value | None:
    E, Hi, Di = hp.n_embd, hp.idx_heads, hp.idx_dim
    p = f"blk.{il}"
    comp = C.Compressor(f"{p}.indexer_compressor", f"lid.{il}", Di, 4, cells)
    rows = C.compressed_rows(b, w, comp, x, pos, hp.eps, starts, new_state)
    iq = B.heads(b, b.matmul(qr, w.need(f"{p}.indexer.attn_q_b.weight", (Hi * Di, hp.q_rank)), "lid_q"), Hi, Di,
                 "lid_q3")
    iq = C.rope_tail(b, iq, pos, tables.fwd[1], hp.n_rot, "lid_q_roped")
    iw = b.scalar("mul", b.matmul(x, w.need(f"{p}.indexer.proj.weight", (Hi, E)), "lid_w"), 1.0 / math.sqrt(Di * Hi),
                  "lid_weights")
    return C.indexer_selection(b, iq, iw, rows, pos, 4, hp.idx_top_k)


def _grouped_output(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, o: Value) -> Value:
    """Group g of heads through its own attn_output_a [OR, H*D/G], then attn_output_b."""
    E, G, OR = hp.n_embd, hp.out_groups, hp.out_rank
    width = hp.n_head * hp.head_dim // G
    p = f"blk.{il}"
    name = f"{p}.attn_output_a.weight"
    info = w.model.tensors.get(name)
    shape = (G * OR, width) if info is not None and len(info.shape) == 2 else (G, OR, width)
    wa = w.need(name, shape)
    wa = wa if wa.dtype == "float32" else b.dequantize(wa, "attn_output_a.w")
    if len(shape) == 2:
        wa = b.reshape(wa, (G, OR, width), "attn_output_a3")
    t = o.shape[0]
    oa = b.emit("head_matmul", [b.reshape(o, (t, G, width), "kqv_groups"), wa], O.NoAttrs(), "attn_output_a")
    oa = b.reshape(oa, (t, G * OR), "attn_output_a_flat")
    return b.matmul(oa, w.need(f"{p}.attn_output_b.weight", (E, G * OR)), "attn_out")


def _act(limit: float) -> tuple[str, float]:
    """ggml_swiglu_clamp when the layer's limit is set (> 1e-6), plain SwiGLU otherwise."""
    return ("swiglu_clamp", limit) if limit > 1e-6 else ("swiglu", 0.0)


def _moe(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, z: Value, tokens: Value) -> Value:
    """sqrt(softplus) router; top-k by score + exp_probs_b (or, on the first `hash_layer_count`
    layers, the token's experts from ffn_gate_tid2eid); weights from the unbiased scores."""
    E, F, X = hp.n_embd, hp.n_ff_exp, hp.n_expert
    p = f"blk.{il}"
    for name in (f"{p}.exp_probs_b_vl.bias", *(f"{p}.ffn_{k}_exps.scale" for k in ("gate", "up", "down"))):
        _loaded_unread(w, name)
    act, limit = _act(hp.clamp_exp[il])
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    exps = [w.need(f"{p}.ffn_{k}_exps.weight", shape) for k, shape in
            (("gate", (X, F, E)), ("up", (X, F, E)), ("down", (X, E, F)))]
    scale = hp.weights_scale if hp.weights_scale != 0.0 else 1.0
    if il < hp.hash_layers:
        return _hash_routed_moe(b, w, hp, il, z, tokens, router, exps, scale, act, limit)
    return B.moe(b, z, router, exps[0], exps[1], exps[2], hp.n_expert_used, scales={}, hidden=F,
                 bias=w.get(f"{p}.exp_probs_b.bias", (X,), f32=True), gating="sqrt_softplus",
                 normalize=hp.weights_norm, weights_scale=scale, act=act, act_limit=limit)


def _hash_routed_moe(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, z: Value, tokens: Value, router: Value,
                     exps: list[Value], scale: float, act: str, limit: float) -> Value:
    """The experts of each token's ffn_gate_tid2eid row (top-k over its one-hot row, the
    sqrt-softplus scores as payload: the weights are the scores at those experts)."""
    t, K = z.shape[0], hp.n_expert_used
    probs = MS.gate_probs_spelled(b, b.matmul(z, router, "ffn_moe_logits"), "sqrt_softplus", "ffn_moe_probs")
    chosen = b.gather(_token_experts(w, hp, il), tokens, "ffn_moe_hash_sel")
    weights, ids = b.emit_multi("topk", [chosen, probs], O.TopK(K), ["ffn_moe_topk", "ffn_moe_ids"])
    if hp.weights_norm:
        denom = b.scalar("max", b.reduce("sum", weights, "ffn_moe_wsum"), 6.103515625e-5, "ffn_moe_wsum_clamped")
        weights = b.binary("div", weights, denom, "ffn_moe_weights")
    if scale != 1.0:
        weights = b.scalar("mul", weights, scale, "ffn_moe_weights_scaled")
    x3 = b.reshape(z, (t, 1, z.shape[1]), "ffn_moe_in")

    def experts(inp: Value, wq: Value, kind: str) -> Value:
        wf = b.dequantize(wq, f"ffn_moe_{kind}.w") if wq.dtype != "float32" else wq
        return b.emit("matmul_id", [inp, wf, ids], O.NoAttrs(), f"ffn_moe_{kind}")

    gated = MS.expert_act_spelled(b, experts(x3, exps[0], "gate"), experts(x3, exps[1], "up"), act, limit,
                                  "ffn_moe_act")
    down = experts(gated, exps[2], "down")
    weighted = b.mul(down, b.reshape(weights, (t, K, 1), "ffn_moe_weights3"), "ffn_moe_weighted")
    return b.reduce("sum", weighted, "ffn_moe_out", axis=1, keepdims=False)


def _token_experts(w: B.Weights, hp: HParams, il: int) -> Value:
    """ffn_gate_tid2eid [V, K] (I32 expert ids per token) as a one-hot [V, X] selection table
    (computed at compile time, stored in its place): top-k over a token's row picks exactly its K
    experts."""
    name = f"blk.{il}.ffn_gate_tid2eid.weight"
    ids = w.int_table(name, (hp.n_vocab, hp.n_expert_used), f"hash layer {il}")
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= hp.n_expert or any(len(set(r)) != len(r) for r in ids):
        raise ModelError(f"{name}: expert ids must be distinct per token and in [0, {hp.n_expert})")
    onehot = np.zeros((hp.n_vocab, hp.n_expert), dtype=np.float32)
    np.put_along_axis(onehot, ids.astype(np.int64), 1.0, axis=1)
    return w.add_derived(name, onehot)  # under the tensor's own name: the graph reads it through this table


def _shared_expert(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, z: Value) -> Value:
    E, Fs = hp.n_embd, hp.n_ff_exp * hp.n_shared
    p = f"blk.{il}"
    for kind in ("gate", "up", "down"):
        _loaded_unread(w, f"{p}.ffn_{kind}_shexp.scale")
    act, limit = _act(hp.clamp_shexp[il])
    gate, up = w.need(f"{p}.ffn_gate_shexp.weight", (Fs, E)), w.need(f"{p}.ffn_up_shexp.weight", (Fs, E))
    return B.shared_ffn(b, z, gate, up, w.need(f"{p}.ffn_down_shexp.weight", (E, Fs)), scales={}, act=act,
                        act_limit=limit)


def _loaded_unread(w: B.Weights, name: str) -> None:
    """Tensors llama.cpp loads for this architecture but its graph never reads (the experts'
    `.scale`, the image-token selection bias)."""
    if w.has(name):
        w.used.add(name)
