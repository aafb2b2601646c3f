"""deepseek32 (llama.cpp `src/models/deepseek32.cpp`, DeepSeek-V3.2; docs/arch/deepseek-glm-minimax-kimi-hy.md §2).

MLA attention in the absorbed form over a latent cache (frontend/latent_attention.py), the lightning
indexer on every layer choosing each query's top `indexer.top_k` tokens (frontend/sparse_indexers/dsa.py;
NEOX indexer rope, key LayerNorm eps 1e-6), leading dense SwiGLU blocks, then a sigmoid-routed MoE
with selection bias `exp_probs_b` and an ungated shared expert. glm-dsa is this block with its own
indexer facts and full/shared indexer layers (archs/glm_dsa.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table
from ..latent_attention import MlaDims, check_dims, low_rank_q, mla_attention
from ..sparse_indexers.dsa import LightningIndexerDims, lightning_indexer

ARCH = "deepseek32"
SIGMOID = 2  # expert_gating_func


@dataclass(frozen=True)
class SigmoidMoeDims:
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int  # the shared expert's hidden width (expert_shared_count * F); 0: none
    weights_norm: bool
    weights_scale: float  # 0 or 1: no scaling


def sigmoid_moe(b: GraphBuilder, w: B.Weights, p: str, x: Value, d: SigmoidMoeDims) -> Value:
    """llama.cpp's build_moe_ffn with sigmoid gating (the routing family's `blocks.moe`: chosen by
    probs + `exp_probs_b`, weighted by the unbiased probs) plus the ungated shared expert."""
    E = int(x.shape[1])
    X, F = d.n_expert, d.n_ff_exp
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    bias = w.get(f"{p}.exp_probs_b.bias", (X,), required=False)
    exps = {k: w.need(f"{p}.ffn_{k}_exps.weight", s) for k, s in (("gate", (X, F, E)), ("up", (X, F, E)),
                                                                    ("down", (X, E, F)))}
    scales = {k: w.get(f"{p}.ffn_{k}_exps.scale", (X,), required=False) for k in exps}
    routed = B.moe(b, x, router, exps["gate"], exps["up"], exps["down"], d.n_used, scales=scales, hidden=F,
                   bias=bias, gating="sigmoid", normalize=d.weights_norm, weights_scale=d.weights_scale or 1.0)
    if not d.n_ff_shexp:
        return routed
    return b.add(routed, swiglu(b, w, f"{p}.ffn", "_shexp", x, d.n_ff_shexp), "ffn_out")


def swiglu(b: GraphBuilder, w: B.Weights, prefix: str, suffix: str, x: Value, hidden: int) -> Value:
    """down(silu(gate(x)) * up(x)) with the optional per-tensor `.scale` of each matrix."""
    E = int(x.shape[1])
    shapes = {"gate": (hidden, E), "up": (hidden, E), "down": (E, hidden)}
    mats = {k: w.need(f"{prefix}_{k}{suffix}.weight", s) for k, s in shapes.items()}
    scales = {k: w.get(f"{prefix}_{k}{suffix}.scale", (1,), required=False) for k in shapes}
    return B.shared_ffn(b, x, mats["gate"], mats["up"], mats["down"], scales=scales)


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    eps: float
    rope_base: float
    freq_scale: float
    n_ctx_train: int
    mla: MlaDims
    indexer: LightningIndexerDims
    indexer_full: tuple[bool, ...]  # per layer: its own indexer (True) or the last full layer's selection
    n_lead_dense: int
    n_ff: int
    moe: SigmoidMoeDims


@dataclass(frozen=True)
class DsaFacts:
    """Where glm-dsa departs from deepseek32."""

    arch: str
    indexer_rope: str
    indexer_key_eps: float
    gating_required: bool  # deepseek32 requires expert_gating_func; glm-dsa defaults it to sigmoid


FACTS = DsaFacts(ARCH, "neox", 1e-6, True)


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    return read_common(keys, n_vocab, FACTS, None)


def read_common(keys: Keys, n_vocab: int, facts: DsaFacts, indexer_full: tuple[bool, ...] | None) -> HParams:
    arch = facts.arch
    n_layer = keys.int("block_count")
    if keys.int("attention.head_count_kv", 1) != 1:
        raise ModelError(f"{arch}: attention.head_count_kv must be 1 (one latent cache head)")
    if keys.int("nextn_predict_layers", 0):
        raise ModelError(f"{arch}: multi-token prediction layers (nextn_predict_layers) are not supported yet")
    if keys.raw("rope.scaling.type", "linear") == "yarn":
        raise ModelError(f"{arch}: YaRN rope scaling is not supported yet")
    if keys.raw("attention.key_length_mla") is None:
        raise ModelError(f"{arch} requires MLA: missing key {arch}.attention.key_length_mla")
    n_rot = keys.int("rope.dimension_count")
    key_mla = keys.int("attention.key_length_mla")
    mla = MlaDims(keys.int("attention.head_count"), keys.int("attention.q_lora_rank"),
                  keys.int("attention.kv_lora_rank"), n_rot, key_mla - n_rot, keys.int("attention.value_length_mla"))
    check_dims(mla, keys.int("attention.key_length"), keys.int("attention.value_length"), arch)
    indexer = LightningIndexerDims(keys.int("attention.indexer.head_count"), keys.int("attention.indexer.key_length"),
                                   keys.int("attention.indexer.top_k"), n_rot, facts.indexer_rope,
                                   facts.indexer_key_eps)
    if min(indexer.n_head, indexer.top_k) <= 0 or indexer.head_dim < n_rot:
        raise ModelError(f"{arch}: indexer head_count/top_k must be positive and key_length >= rope "
                         f"({indexer.n_head}, {indexer.top_k}, {indexer.head_dim} < {n_rot})")
    gating = keys.int("expert_gating_func", None if facts.gating_required else SIGMOID)
    if gating != SIGMOID:
        raise ModelError(f"{arch}: expert_gating_func {gating} is not supported yet (only 2, sigmoid)")
    if keys.int("expert_group_count", 0) > 1:
        raise ModelError(f"{arch}: grouped expert selection (expert_group_count > 1) is not supported yet")
    n_expert, n_used = keys.int("expert_count"), keys.int("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise ModelError(f"{arch}: needs 0 < expert_used_count ({n_used}) <= expert_count ({n_expert})")
    n_ff_exp = keys.int("expert_feed_forward_length")
    moe = SigmoidMoeDims(n_expert, n_used, n_ff_exp, keys.int("expert_shared_count", 0) * n_ff_exp,
                         bool(keys.raw("expert_weights_norm", False)), keys.float("expert_weights_scale", 0.0))
    full = indexer_full if indexer_full is not None else (True,) * n_layer
    return HParams(n_vocab=n_vocab, n_embd=keys.int("embedding_length"), n_layer=n_layer,
                   eps=keys.float("attention.layer_norm_rms_epsilon"), rope_base=keys.float("rope.freq_base", 10000.0),
                   freq_scale=rope_freq_scale(keys), n_ctx_train=keys.int("context_length"), mla=mla,
                   indexer=indexer, indexer_full=full, n_lead_dense=keys.int("leading_dense_block_count", 0),
                   n_ff=keys.int("feed_forward_length", 0), moe=moe)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.mla.n_rot, hp.rope_base, hp.freq_scale, None)))
    new_state: dict[str, Value] = {}
    selection: list[Value] = []  # the most recent full indexer layer's selection

    def layer(il: int, x: Value) -> Value:
        return _layer(b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state, selection)

    x = B.layers(b, hp.n_layer, inp.x, layer)
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value], selection: list[Value]) -> Value:
    E, p = hp.n_embd, f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    qr = low_rank_q(b, w, p, h, hp.mla, hp.eps)
    if hp.indexer_full[il]:
        selection[:] = [lightning_indexer(b, w, hp.indexer, il, h, qr, pos, table, n_ctx, new_state)]
    elif not selection:
        raise ModelError(f"{ARCH}: layer {il} shares the indexer selection but no earlier layer computes one")
    scale = 1.0 / math.sqrt(hp.mla.key_dim)
    o = mla_attention(b, w, p, il, h, qr, hp.mla, hp.eps, pos, table, n_ctx, scale, new_state, selection[0])
    x = b.add(x, o, "ffn_inp")
    z = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    y = swiglu(b, w, f"{p}.ffn", "", z, hp.n_ff) if il < hp.n_lead_dense else sigmoid_moe(b, w, p, z, hp.moe)
    return b.add(x, y, "l_out")
