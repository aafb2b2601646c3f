"""minimax-m3 (llama.cpp `src/models/minimax-m3.cpp`; docs/arch/deepseek-glm-minimax-kimi-hy.md §4).

GQA with q/k/v biases and per-tensor scales, one RMSNorm gamma shared by every q (k) head, NEOX
rope on the first `rope.dimension_count` dims; leading dense blocks, then sigmoid-routed MoE
blocks (selection bias, shared expert); swigluoai in every FFN. llama.cpp loads the FFN `.scale`
tensors and never reads them.

The MoE blocks attend through MSA: per KV group an indexer query (own projection, RMSNorm, rope)
scores every cached indexer key (own cache, `cache_idx.<il>`), each block of
`indexer.block_size` cells takes its largest score, the `indexer.local_blocks` blocks ending at
the query's block are always kept, and the group's query heads attend only to cells of the
`indexer.top_k` selected blocks (causal). A budget covering the context is exactly dense.

llama.cpp runs MSA only with flash attention, which reads K and V as F16: K and V are rounded to
half precision before they are cached, here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value
from ggufc.ir.sparse_indexers import BlockMask, BlockTopK
from ggufc.ir.sparse_indexers_spelled import block_score_spelled

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table
from . import llama

ARCH = "minimax-m3"
FLASH_ATTN_Q_TILE = 64  # query rows per tile of llama.cpp's CPU flash attention (GGML_FA_TILE_Q)
GATINGS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values


@dataclass(frozen=True)
class MsaParams:
    n_head: int  # indexer heads: one per KV group
    head_dim: int  # Di
    top_k: int  # blocks kept per query and group
    block: int  # cells per block
    local: int  # trailing blocks always kept


@dataclass(frozen=True)
class HParams(llama.HParams):
    n_dense_lead: int
    n_ff_exp: int
    n_expert_shared: int
    gating: str
    weights_norm: bool
    weights_scale: float  # 1 when the key is absent or 0 (llama.cpp scales only by other values)
    msa: MsaParams


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_head = keys.int("embedding_length"), keys.int("attention.head_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    if keys.int("attention.value_length", head_dim) != head_dim:
        raise ModelError("minimax-m3 requires attention.key_length == attention.value_length")
    n_head_kv = keys.int("attention.head_count_kv", n_head)
    n_rot = keys.int("rope.dimension_count", head_dim)
    n_expert, n_used = keys.int("expert_count", 0), keys.int("expert_used_count", 0)
    gating = keys.int("expert_gating_func")
    msa = MsaParams(keys.int("attention.indexer.head_count"), keys.int("attention.indexer.key_length"),
                    keys.int("attention.indexer.top_k"), keys.int("attention.indexer.block_size"),
                    keys.int("attention.indexer.local_blocks"))
    n_layer, n_dense_lead = keys.int("block_count"), keys.int("leading_dense_block_count", 0)
    _check(n_head, n_head_kv, head_dim, n_rot, gating, msa)
    if n_layer > n_dense_lead and (n_expert <= 0 or not 0 < n_used <= n_expert):
        raise ModelError("minimax-m3 requires expert_count > 0 and 0 < expert_used_count <= expert_count "
                         "(its blocks past the leading dense ones are MoE)")
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_rot=n_rot, n_ff=keys.int("feed_forward_length", 0),
        eps=keys.float("attention.layer_norm_rms_epsilon"), rope_base=keys.float("rope.freq_base", 10000.0),
        freq_scale=rope_freq_scale(keys), n_ctx_train=keys.int("context_length"),
        n_dense_lead=n_dense_lead, n_expert=n_expert, n_expert_used=n_used,
        n_ff_exp=keys.int("expert_feed_forward_length"), n_expert_shared=keys.int("expert_shared_count"),
        gating=GATINGS[gating], weights_norm=bool(keys.raw("expert_weights_norm", False)),
        weights_scale=keys.float("expert_weights_scale", 0.0) or 1.0, msa=msa,
    )


def _check(n_head: int, n_head_kv: int, head_dim: int, n_rot: int, gating: int, msa: MsaParams) -> None:
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ModelError(f"minimax-m3: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if n_rot % 2 or not 0 < n_rot <= min(head_dim, msa.head_dim):
        raise ModelError(f"minimax-m3: rope.dimension_count {n_rot} must be even and at most the head dims "
                         f"({head_dim}, indexer {msa.head_dim})")
    if gating not in GATINGS:
        raise ModelError(f"minimax-m3: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    if msa.n_head != n_head_kv:
        raise ModelError(f"minimax-m3: attention.indexer.head_count ({msa.n_head}) must equal head_count_kv "
                         f"({n_head_kv}): one indexer head per KV group")
    if min(msa.head_dim, msa.top_k, msa.block) <= 0 or msa.local < 1:
        raise ModelError(f"minimax-m3: indexer key_length, top_k and block_size must be positive and local_blocks "
                         f">= 1 (got {msa.head_dim}, {msa.top_k}, {msa.block}, {msa.local})")


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, None)))
    new_state: dict[str, Value] = {}

    def layer(il: int, x: Value) -> Value:
        b, p = w.b, f"blk.{il}"
        h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (hp.n_embd,)), hp.eps, "attn_norm")
        x = b.add(x, _attention(b, w, hp, il, h, inp.pos, inp.table, n_ctx, new_state), "ffn_inp")
        z = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (hp.n_embd,)), hp.eps, "ffn_norm")
        ffn = _dense_ffn(w, hp, p, z) if il < hp.n_dense_lead else _moe_ffn(w, hp, p, z)
        return b.add(x, ffn, "l_out")

    x = B.layers(w.b, hp.n_layer, inp.x, layer)
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _proj(w: B.Weights, x: Value, name: str, n_out: int, n_in: int, *, bias: bool = True) -> Value:
    """x @ W.T * scale + bias (llama.cpp's build_lora_mm with the tensor's scale, then the bias; only
    q, k and v have one)."""
    return B.linear(w.b, x, w.need(f"{name}.weight", (n_out, n_in)), name.split(".")[-1],
                    bias=w.get(f"{name}.bias", (n_out,), required=False) if bias else None,
                    scale=w.get(f"{name}.scale", (1,), required=False))


def _attention(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, pos: Value, table: Value, n_ctx: int,
               new_state: dict[str, Value]) -> Value:
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    p = f"blk.{il}"
    q = B.heads(b, _proj(w, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    q = B.rope(b, B.rms_norm(b, q, w.need(f"{p}.attn_q_norm.weight", (D,)), hp.eps, "Qcur_normed"), pos, table,
               "neox", hp.n_rot, "Qrope")
    k = B.rope(b, B.rms_norm(b, k, w.need(f"{p}.attn_k_norm.weight", (D,)), hp.eps, "Kcur_normed"), pos, table,
               "neox", hp.n_rot, "Krope")
    k, v = b.unary("round_f16", k, "Kcur_f16"), b.unary("round_f16", v, "Vcur_f16")
    mask = _msa_mask(b, w, hp, il, h, pos, table, n_ctx, new_state) if il >= hp.n_dense_lead else None
    # llama.cpp's flash attention takes calls shorter than its query tile one row at a time,
    # accumulating P.V in F16: the dense layers' goldens show it, the MSA layers' (a flash
    # attention per KV group) agree with float32 accumulation instead (both measured)
    a = B.attention(b, q, k, v, pos, B.kv_cache(b, il, n_ctx, Hkv, D), 1.0 / math.sqrt(D), new_state, il, mask,
                    f16_pv_below=FLASH_ATTN_Q_TILE if mask is None else 0)
    return _proj(w, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D, bias=False)


def _msa_mask(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, pos: Value, table: Value, n_ctx: int,
              new_state: dict[str, Value]) -> Value:
    """The indexer: roped keys into their own cache, per-group block scores, the block selection,
    and its additive [Hkv, T, P+T] mask."""
    msa, E = hp.msa, hp.n_embd
    p = f"blk.{il}.indexer"
    k = B.heads(b, b.matmul(h, w.need(f"{p}.k_proj.weight", (msa.head_dim, E)), "indexer_k_proj"), 1, msa.head_dim,
                "indexer_k3")
    k = B.rms_norm(b, k, w.need(f"{p}.k_norm.weight", (msa.head_dim,)), hp.eps, "indexer_k_normed")
    k = b.reshape(B.rope(b, k, pos, table, "neox", hp.n_rot, "indexer_k_roped"), (h.shape[0], msa.head_dim),
                  "indexer_k")
    n_cells = -(-n_ctx // msa.block) * msa.block  # whole blocks
    cache = b.emit("cache_write", [b.state(f"cache_idx.{il}", (n_cells, msa.head_dim)), k, pos], O.NoAttrs(),
                   f"cache_idx.{il}")
    new_state[f"cache_idx.{il}"] = cache
    q = B.heads(b, b.matmul(h, w.need(f"{p}.q_proj.weight", (msa.n_head * msa.head_dim, E)), "indexer_q_proj"),
                msa.n_head, msa.head_dim, "indexer_q3")
    q = B.rms_norm(b, q, w.need(f"{p}.q_norm.weight", (msa.head_dim,)), hp.eps, "indexer_q_normed")
    q = B.rope(b, q, pos, table, "neox", hp.n_rot, "indexer_q")
    score = block_score_spelled(b, q, cache, msa.block, "indexer_block_score")
    sel = b.emit("block_topk", [score, pos], BlockTopK(msa.block, msa.top_k, msa.local), "indexer_top_k")
    return b.emit("block_mask", [sel, pos], BlockMask(msa.block), "kq_mask_blocks")


def _ffn_scales_unread(w: B.Weights, p: str, kinds: tuple[str, ...]) -> None:
    w.used.update(n for k in kinds if w.has(n := f"{p}.ffn_{k}.scale"))


def _dense_ffn(w: B.Weights, hp: HParams, p: str, z: Value) -> Value:
    E, F = hp.n_embd, hp.n_ff
    _ffn_scales_unread(w, p, ("gate", "up", "down"))
    return B.shared_ffn(w.b, z, w.need(f"{p}.ffn_gate.weight", (F, E)), w.need(f"{p}.ffn_up.weight", (F, E)),
                        w.need(f"{p}.ffn_down.weight", (E, F)), scales={}, act="swiglu_oai")


def _moe_ffn(w: B.Weights, hp: HParams, p: str, z: Value) -> Value:
    b, E, F, X = w.b, hp.n_embd, hp.n_ff_exp, hp.n_expert
    Fs = F * hp.n_expert_shared
    _ffn_scales_unread(w, p, ("gate_exps", "up_exps", "down_exps", "gate_shexp", "up_shexp", "down_shexp"))
    routed = B.moe(b, z, w.need(f"{p}.ffn_gate_inp.weight", (X, E)), w.need(f"{p}.ffn_gate_exps.weight", (X, F, E)),
                   w.need(f"{p}.ffn_up_exps.weight", (X, F, E)), w.need(f"{p}.ffn_down_exps.weight", (X, E, F)),
                   hp.n_expert_used, scales={}, hidden=F, bias=w.need(f"{p}.exp_probs_b.bias", (X,)),
                   gating=hp.gating, normalize=hp.weights_norm, weights_scale=hp.weights_scale, act="swiglu_oai")
    shared = B.shared_ffn(b, z, w.need(f"{p}.ffn_gate_shexp.weight", (Fs, E)),
                          w.need(f"{p}.ffn_up_shexp.weight", (Fs, E)), w.need(f"{p}.ffn_down_shexp.weight", (E, Fs)),
                          scales={}, act="swiglu_oai")
    return b.add(routed, shared, "ffn_out")
