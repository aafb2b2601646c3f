"""qwen4exp (llama.cpp `src/models/qwen4exp.cpp`, "Qwen3.8-Flash-Next"; docs/arch/qwen-family.md §6).

The qwen35/qwen3next hybrid (gated delta-net linear layers, gated full-attention layers with IMROPE,
softmax top-k MoE plus a sigmoid-gated shared expert), with these differences:

* the residual is `hc` streams wide (hyper-connections): before each token mixer and each FFN a
  low-rank, sigmoid-gated mix of the streams (RMSNorm per stream, down, silu, up, sigmoid gate,
  mean over streams) is the block input, and the block output is scattered back into every stream
  with weight 2*sigmoid(inject/hc); the final mix (no inject) stands in for the output norm;
* the delta-net output gate is sigmoid(z) (not silu), q/k heads are shared tiled (`h % Hk`);
* full-attention layers with a compress ratio r > 0 attend only to QSA's selection: the top
  `indexer.top_k + r - 1` cells by block score (mean-pooled raw indexer keys per block of r
  positions, normalised and rotated at the block start, ReLU per head, summed) plus the incomplete
  tail; dense attention whenever the budget covers the context. The q/k/v biases are ignored;
* optionally one linear layer gets the PLE block: an n-gram hash of the token history selects
  per-layer embedding rows, gated into the streams and through a dilated causal conv.
"""

from __future__ import annotations

import dataclasses

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from .. import hyper_connections as HC
from .. import linear_attention as DN
from .. import ngram_embedding as NG
from ..hparams import Keys, ModelError, rope_table
from ..sparse_indexers import qsa as QSA
from . import qwen3next, qwen35

ARCH = "qwen4exp"

FACTS = qwen35.HybridFacts(head_map="tiled", rope_mode="imrope", ba_layout="split", linear_scales=True,
                           gate_act="sigmoid")


@dataclasses.dataclass(frozen=True)
class HParams(qwen35.HParams):
    n_hc: int = 0  # hyper_connection.count
    hc_rank: int = 0  # hyper_connection.low_rank
    indexer: QSA.IndexerDims | None = None
    compress_ratios: tuple[int, ...] = ()  # per layer; 0 = dense attention
    ple: NG.PleParams | None = None


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    common = qwen35.read_common(keys, n_vocab)
    n_layer_all, D = common["n_layer_all"], common["head_dim"]
    sections = keys.raw("rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) != 4:
        raise ModelError("missing required key qwen4exp.rope.dimension_sections (4 section sizes)")
    sections_t = tuple(int(s) for s in sections)
    n_expert, n_used = keys.int("expert_count", 0), keys.int("expert_used_count", 0)
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ModelError("qwen4exp requires expert_count > 0 and 0 < expert_used_count <= expert_count")
    n_hc, rank = keys.int("hyper_connection.count"), keys.int("hyper_connection.low_rank")
    if n_hc <= 1 or rank <= 0:
        raise ModelError(f"qwen4exp: hyper_connection.count must be > 1 ({n_hc}) and low_rank > 0 ({rank})")
    idx = QSA.IndexerDims(keys.int("attention.indexer.head_count"), keys.int("attention.indexer.key_length"),
                         keys.int("attention.indexer.top_k"), common["n_rot"], sections_t)
    if min(idx.n_head, idx.head_dim, idx.top_k) <= 0 or idx.head_dim < common["n_rot"]:
        raise ModelError(f"qwen4exp: indexer head_count/key_length/top_k must be positive, key_length >= n_rot "
                         f"({idx.n_head}, {idx.head_dim}, {idx.top_k}, n_rot {common['n_rot']})")
    if sum(sections_t) > min(D, idx.head_dim):
        raise ModelError(f"qwen4exp: rope.dimension_sections {list(sections_t)} sum past the head dim")
    ratios = tuple(keys.per_layer("attention.compress_ratios", n_layer_all, 0))
    if any(not 0 <= r <= 64 for r in ratios):
        raise ModelError(f"qwen4exp: attention.compress_ratios must be in [0, 64], got {list(ratios)}")
    ple = _read_ple(keys, common)
    return HParams(**common, rope_sections=sections_t, n_expert=n_expert, n_expert_used=n_used,
                   n_ff_exp=keys.int("expert_feed_forward_length", 0) or common["n_ff"] // n_used,
                   n_ff_shexp=keys.int("expert_shared_feed_forward_length", 0) or common["n_ff"],
                   n_hc=n_hc, hc_rank=rank, indexer=idx, compress_ratios=ratios, ple=ple)


def _read_ple(keys: Keys, common: dict) -> NG.PleParams | None:
    layers = keys.raw("ple.layers")
    if layers is None or layers == []:
        return None
    layers = layers if isinstance(layers, list) else [layers]
    if len(layers) != 1:
        raise ModelError(f"qwen4exp.ple.layers lists {len(layers)} layers, but only one PLE layer is supported")
    il = int(layers[0])
    if not 0 <= il < common["n_layer"] or not common["recurrent"][il]:
        raise ModelError(f"qwen4exp: PLE layer {il} must be a linear-attention layer")
    ngram, per = keys.int("ple.ngram_size"), keys.int("ple.heads_per_ngram")
    n_heads = (ngram - 1) * per
    if not 2 <= ngram <= 8 or not 1 <= n_heads <= 64:
        raise ModelError(f"qwen4exp: PLE n-gram size {ngram} or head count {n_heads} out of range")

    def u64s(name: str, n_min: int) -> tuple[int, ...]:
        raw = keys.raw(name)
        if not isinstance(raw, list) or len(raw) < n_min:
            raise ModelError(f"key qwen4exp.{name} needs at least {n_min} entries")
        return tuple(int(v) for v in raw)

    pp = NG.PleParams(il, ngram, per, keys.int("embedding_length_per_layer_input"), keys.int("ple.conv_kernel"),
                      keys.int("ple.eos_token_id"), u64s("ple.layer_multipliers", ngram),
                      u64s("ple.head_offsets", n_heads), u64s("ple.head_vocab_sizes", n_heads))
    if pp.head_dim <= 0 or pp.conv_kernel <= 0 or pp.head_dim * n_heads != common["n_embd"]:
        raise ModelError(f"qwen4exp: PLE needs per-layer width * heads == n_embd ({pp.head_dim} * {n_heads} != "
                         f"{common['n_embd']}) and a positive conv kernel")
    if any(s <= 0 or o + s > 2**31 - 1 for o, s in zip(pp.offsets[:n_heads], pp.sizes[:n_heads], strict=True)):
        raise ModelError("qwen4exp: a PLE head range does not fit the int32 row index")
    return pp


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    E, hc = hp.n_embd, hp.n_hc
    inp = B.decoder_inputs(w, hp.n_vocab, E, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, None, hp.rope_sections)))
    streams = HC.hc_expand(b, inp.x, hc)
    new_state: dict[str, Value] = {}
    ple = hp.ple
    ple_emb = NG.ple_embedding(b, w, ple, inp.tokens, inp.pos, n_ctx, new_state) if ple is not None else None

    def layer(il: int, streams: Value) -> Value:
        p = f"blk.{il}"
        if ple is not None and ple_emb is not None and il == ple.layer:
            streams = NG.ple_block(b, w, ple, streams, ple_emb, hc, hp.eps, new_state)
        m, post = HC.hc_pre(b, streams, HC.hc_weights(w, f"{p}.hc_attn", hc, E, hp.hc_rank), hc, hp.eps,
                            "hc_attn_mix")
        if hp.recurrent[il]:
            y = qwen35.linear_attention_layer(b, w, hp, FACTS, il, m, new_state)
        else:
            y = _full_attention(b, w, hp, il, m, inp.pos, inp.table, n_ctx, new_state)
        streams = HC.hc_post(b, streams, y, post, "hc_attn_combine")
        m, post = HC.hc_pre(b, streams, HC.hc_weights(w, f"{p}.hc_ffn", hc, E, hp.hc_rank), hc, hp.eps,
                            "hc_ffn_mix")
        return HC.hc_post(b, streams, qwen3next.moe_ffn(b, w, hp, p, m), post, "l_out")

    streams = B.layers(b, hp.n_layer, streams, layer)
    qwen35.skip_mtp_layers(w, hp)

    def collapse(streams: Value) -> Value:  # the final mix stands in for output_norm
        out_mix = HC.hc_weights(w, "output_hc", hc, E, hp.hc_rank, inject=False)
        return HC.hc_collapse(b, streams, out_mix, hc, hp.eps, "result_norm")

    return B.output_head(w, inp, streams, all_logits, new_state, collapse, output_scale=True)


def _full_attention(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, m: Value, pos: Value, table: Value,
                    n_ctx: int, new_state: dict[str, Value]) -> Value:
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    p = f"blk.{il}"
    # the q/k/v biases are loaded by llama.cpp but never read by this graph
    w.used.update(n for n in (f"{p}.attn_q.bias", f"{p}.attn_k.bias", f"{p}.attn_v.bias") if w.has(n))
    qg = qwen35.proj(w, b, m, f"{p}.attn_q", 2 * H * D, E, scale=True, short="Qcur_full_proj")
    k = qwen35.proj(w, b, m, f"{p}.attn_k", Hkv * D, E, scale=True, short="Kcur_proj")
    v = qwen35.proj(w, b, m, f"{p}.attn_v", Hkv * D, E, scale=True, short="Vcur_proj")
    q, gate = DN.split_q_gate(b, qg, H, D)
    ratio = hp.compress_ratios[il]
    idx = hp.indexer
    assert idx is not None
    mask = None
    if ratio > 0:
        block_table = w.add_derived(f"qsa_block_rope.r{ratio}",
                                    QSA.block_rope_table(n_ctx, ratio, hp.n_rot, hp.rope_base, hp.freq_scale))
        mask = QSA.qsa_mask(b, w, idx, il, m, pos, table, block_table, ratio, hp.eps, n_ctx, new_state)
    else:  # no ratio: dense attention; the indexer tensors are loaded and unused (as in llama.cpp)
        for name in ("q_proj", "k_proj", "q_norm", "k_norm"):
            if not w.has(f"{p}.indexer.{name}.weight"):
                raise ModelError(f"missing tensor {p}.indexer.{name}.weight")
            w.used.add(f"{p}.indexer.{name}.weight")
    dims = DN.GatedAttentionDims(H, Hkv, D, hp.n_rot, "imrope", hp.rope_sections)
    a = DN.gated_attention(b, dims, il, q, gate, k, v, q_norm=w.need(f"{p}.attn_q_norm.weight", (D,)),
                           k_norm=w.need(f"{p}.attn_k_norm.weight", (D,)), eps=hp.eps, pos=pos, rope_table=table,
                           n_ctx=n_ctx, new_state=new_state, mask=mask)
    return qwen35.proj(w, b, a, f"{p}.attn_output", E, H * D, scale=True, short="attn_output")
