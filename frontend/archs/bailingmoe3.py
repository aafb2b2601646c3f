"""bailingmoe3, Ling 3.0 (llama.cpp `src/models/bailingmoe3.cpp`; docs/arch/wave3-*.md §2).

A hybrid of KDA linear-attention layers (`head_count_kv` 0 for the layer: kimi-k3's delta rule with
a decay per key index, frontend/linear_attention.py `kda`, here with a full-rank decay projection
`ssm_f_a` and `ssm_a` stored as +exp(A_log)) and MLA layers (frontend/latent_attention.py, with or without
Q-LoRA, rope on q_pe/k_pe: NORM, or M-RoPE when `rope.dimension_sections` is set, scale
1/sqrt(key_length_mla) with no YaRN mscale), whose heads' output is multiplied by one sigmoid gate
per head (`attn_gate` [H, E]). Leading dense blocks are SwiGLU FFNs, the others a routed MoE
(gating per `expert_gating_func`, selection bias `exp_probs_b`) plus an always-active shared expert.
Every SwiGLU is clamped after its SiLU, min(silu(g), L) * clip(u, -L, L), by the layer's
`swiglu_clamp_exp` (routed experts) or `swiglu_clamp_shexp` (shared expert and dense FFN); a limit
<= 1e-6 is no clamp. MTP (nextn) blocks are loaded and not run. llama.cpp reads none of the `.scale`
tensors nor the KDA q/k/v biases this architecture may carry.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table
from ..latent_attention import MlaDims, check_dims, low_rank_q, mla_attention
from ..linear_attention import KdaDims, KdaWeights, kda, kda_conv_kernel
from .qwen35 import skip_mtp_layers

ARCH = "bailingmoe3"
GATINGS = {1: "softmax", 2: "sigmoid", 4: "sqrt_softplus"}  # expert_gating_func
CLAMP_OFF = 1e-6  # llama.cpp clamps only above this limit


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int  # executed layers (block_count - nextn_predict_layers)
    n_layer_all: int
    n_ctx_train: int
    eps: float
    rope_base: float
    freq_scale: float
    rope_sections: tuple[int, ...] | None  # M-RoPE (rope mode "neox" over a sectioned table); None: NORM
    kda_layers: tuple[bool, ...]  # head_count_kv == 0
    mla: MlaDims
    kda: KdaDims
    n_lead_dense: int
    n_ff: int
    n_expert: int
    n_used: int
    n_ff_exp: tuple[int, ...]  # per layer
    n_ff_shexp: tuple[int, ...]
    gating: str
    weights_norm: bool
    weights_scale: float
    clamp_exp: tuple[float, ...]  # per layer, 0: off
    clamp_shexp: tuple[float, ...]


def _per_layer(keys: Keys, name: str, n: int, default: float | None = None) -> tuple[float, ...]:
    """A key that is one number or one per layer (llama.cpp's get_key_or_arr)."""
    v = keys.raw(name, default)
    if v is None:
        raise ModelError(f"missing required key {ARCH}.{name}")
    vals = list(v) if isinstance(v, list) else [v] * n
    if len(vals) != n or not all(isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in vals):
        raise ModelError(f"key {ARCH}.{name} must be a number or {n} numbers (one per layer), got {v!r}")
    return tuple(float(x) for x in vals)


def _rope_sections(keys: Keys) -> tuple[int, ...] | None:
    """M-RoPE when the sections give t and h pairs (llama.cpp's use_mrope), else NORM rope."""
    raw = keys.raw("rope.dimension_sections")
    if raw is None:
        return None
    sections = tuple(int(s) for s in (raw if isinstance(raw, list) else [raw]))
    return sections if len(sections) >= 2 and sections[0] > 0 and sections[1] > 0 else None


def _read_mla(keys: Keys, n_head: int, any_mla: bool) -> MlaDims:
    n_rot, key_mla = keys.int("rope.dimension_count"), keys.int("attention.key_length_mla")
    kv_lora = keys.int("attention.kv_lora_rank")
    mla = MlaDims(n_head, keys.int("attention.q_lora_rank", 0), kv_lora, n_rot, key_mla - n_rot,
                  keys.int("attention.value_length_mla"))
    if any_mla:
        check_dims(dataclasses.replace(mla, q_lora=max(mla.q_lora, 1)), keys.int("attention.key_length"), kv_lora,
                   ARCH)
    return mla


def _read_kda(keys: Keys, n_head: int, any_kda: bool) -> KdaDims:
    lb = keys.float("kda.gate_lower_bound")
    if not lb < 0:
        raise ModelError(f"{ARCH}: kda.gate_lower_bound must be negative, got {lb}")
    if not keys.raw("kda.safe_gate", True):
        raise ModelError(f"{ARCH}: kda.safe_gate false is not supported (llama.cpp requires the safe gate)")
    dims = KdaDims(n_head, keys.int("kda.head_dim"), keys.int("ssm.conv_kernel"), lb)
    if any_kda and (dims.head_dim <= 0 or dims.conv_kernel < 2):
        raise ModelError(f"{ARCH}: kda.head_dim must be positive and ssm.conv_kernel at least 2")
    return dims


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_all = keys.int("block_count")
    nextn = keys.int("nextn_predict_layers", 0)
    if not 0 <= nextn < n_all:
        raise ModelError(f"{ARCH}: nextn_predict_layers ({nextn}) must be below block_count ({n_all})")
    n_layer = n_all - nextn
    gating = GATINGS.get(keys.int("expert_gating_func"))
    if gating is None:
        raise ModelError(f"{ARCH}: expert_gating_func {keys.int('expert_gating_func')} is not supported (1 softmax, "
                         "2 sigmoid, 4 sqrt-softplus)")
    if keys.int("expert_group_count", 0) > 1:
        raise ModelError(f"{ARCH}: grouped expert selection (expert_group_count > 1) is not supported yet")
    if keys.raw("rope.scaling.type", "linear") == "yarn":
        raise ModelError(f"{ARCH}: YaRN rope scaling is not supported yet")
    n_head = keys.per_layer("attention.head_count", n_all)[0]  # llama.cpp sizes KDA and MLA by layer 0's
    if n_head <= 0:
        raise ModelError(f"{ARCH}: attention.head_count of layer 0 must be positive, got {n_head}")
    kda_layers = tuple(k == 0 and il < n_layer for il, k in enumerate(keys.per_layer("attention.head_count_kv",
                                                                                      n_all)))
    n_expert, n_used = keys.int("expert_count"), keys.int("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise ModelError(f"{ARCH}: needs 0 < expert_used_count ({n_used}) <= expert_count ({n_expert})")
    n_ff_exp = tuple(int(f) for f in _per_layer(keys, "expert_feed_forward_length", n_all))
    shared = max(keys.int("expert_shared_count"), 1)
    n_ff_shexp = tuple(int(f) for f in _per_layer(keys, "expert_shared_feed_forward_length", n_all,
                                                  n_ff_exp[0] * shared))
    scale = keys.float("expert_weights_scale", 0.0)
    return HParams(
        n_vocab=n_vocab, n_embd=keys.int("embedding_length"), n_layer=n_layer, n_layer_all=n_all,
        n_ctx_train=keys.int("context_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0), freq_scale=rope_freq_scale(keys),
        rope_sections=_rope_sections(keys), kda_layers=kda_layers,
        mla=_read_mla(keys, n_head, not all(kda_layers[:n_layer])), kda=_read_kda(keys, n_head, any(kda_layers)),
        n_lead_dense=keys.int("leading_dense_block_count"), n_ff=keys.int("feed_forward_length", 0),
        n_expert=n_expert, n_used=n_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp, gating=gating,
        weights_norm=bool(keys.raw("expert_weights_norm", False)),
        weights_scale=scale if scale not in (0.0, 1.0) else 1.0,  # llama.cpp skips 0 and 1
        clamp_exp=_per_layer(keys, "swiglu_clamp_exp", n_all, 0.0),
        clamp_shexp=_per_layer(keys, "swiglu_clamp_shexp", n_all, 0.0))


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived("rope_table", rope_table(
        n_ctx, hp.mla.n_rot, hp.rope_base, hp.freq_scale, None, hp.rope_sections, interleaved=False)))
    new_state: dict[str, Value] = {}
    w.used.update(n for n in w.model.tensors if n.endswith(".scale"))  # llama.cpp never applies them
    skip_mtp_layers(w, hp)

    def layer(il: int, x: Value) -> Value:
        return _layer(b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state)

    x = B.layers(b, hp.n_layer, inp.x, layer)
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, p = hp.n_embd, f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    a = (_kda_layer(b, w, hp, il, h, new_state) if hp.kda_layers[il]
         else _mla_layer(b, w, hp, il, h, pos, table, n_ctx, new_state))
    x = b.add(x, a, "ffn_inp")
    z = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    f = (_ffn(b, w, f"{p}.ffn", "", z, hp.n_ff, hp.clamp_shexp[il]) if il < hp.n_lead_dense
         else _moe(b, w, hp, il, z))
    return b.add(x, f, "l_out")


def _kda_layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, new_state: dict[str, Value]) -> Value:
    E, p, d = hp.n_embd, f"blk.{il}", hp.kda
    H, D, inner = d.n_head, d.head_dim, d.inner
    w.ignore(*(f"{p}.attn_{k}.bias" for k in "qkv"))  # loaded, never read
    wt = KdaWeights(
        q=w.need(f"{p}.attn_q.weight", (inner, E)), k=w.need(f"{p}.attn_k.weight", (inner, E)),
        v=w.need(f"{p}.attn_v.weight", (inner, E)),
        conv=(kda_conv_kernel(w, f"{p}.ssm_conv1d_q.weight", d), kda_conv_kernel(w, f"{p}.ssm_conv1d_k.weight", d),
              kda_conv_kernel(w, f"{p}.ssm_conv1d_v.weight", d)),
        f_a=w.need(f"{p}.ssm_f_a.weight", (inner, E)), f_b=None, dt_bias=w.need(f"{p}.ssm_dt.bias", (inner,)),
        ssm_a=b.scalar("mul", _ssm_a(w, f"{p}.ssm_a", H), -1.0, "ssm_a_negated"),  # the block takes kimi's -exp
        beta=B.per_head_rows(w, f"{p}.ssm_beta.weight", H, E),
        out_gate=w.need(f"{p}.ssm_g_a.weight", (inner, E)), norm=w.need(f"{p}.ssm_norm.weight", (D,)))
    o = kda(b, d, il, h, wt, hp.eps, new_state)
    return B.linear(b, o, w.need(f"{p}.attn_output.weight", (E, inner)), "kda_out")


def _ssm_a(w: B.Weights, name: str, n_head: int) -> Value:
    """+exp(A_log) per head as [H, 1]; stored [1, H] in ggml order, or 1-D."""
    info = w.model.tensors.get(name)
    if info is not None and len(info.shape) == 2:
        return w.need(name, (n_head, 1))
    return w.b.reshape(w.need(name, (n_head,)), (n_head, 1), "ssm_a_heads")


def _mla_layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, pos: Value, table: Value, n_ctx: int,
               new_state: dict[str, Value]) -> Value:
    p, dims = f"blk.{il}", hp.mla
    qr = low_rank_q(b, w, p, h, dims, hp.eps) if dims.q_lora else h
    gate = B.linear(b, h, B.per_head_rows(w, f"{p}.attn_gate.weight", dims.n_head, hp.n_embd), "attn_gate")
    return mla_attention(b, w, p, il, h, qr, dims, hp.eps, pos, table, n_ctx, 1.0 / math.sqrt(dims.key_dim),
                         new_state, None, output_scale=False, head_gate=gate,
                         rope_mode="neox" if hp.rope_sections else "norm")


def _act(limit: float) -> tuple[str, float]:
    return ("swiglu_clamp_after", limit) if limit > CLAMP_OFF else ("swiglu", 0.0)


def _ffn(b: GraphBuilder, w: B.Weights, prefix: str, suffix: str, x: Value, hidden: int, limit: float) -> Value:
    """down(act(gate x, up x)), SwiGLU clamped after the SiLU when `limit` is set (dense or shared expert)."""
    E = int(x.shape[1])
    mats = {k: w.need(f"{prefix}_{k}{suffix}.weight", s)
            for k, s in (("gate", (hidden, E)), ("up", (hidden, E)), ("down", (E, hidden)))}
    act, lim = _act(limit)
    return B.shared_ffn(b, x, mats["gate"], mats["up"], mats["down"], scales={}, act=act, act_limit=lim)


def _moe(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, z: Value) -> Value:
    E, X, F, p = hp.n_embd, hp.n_expert, hp.n_ff_exp[il], f"blk.{il}"
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    bias = w.get(f"{p}.exp_probs_b.bias", (X,), required=False)
    exps = {k: w.need(f"{p}.ffn_{k}_exps.weight", s) for k, s in (("gate", (X, F, E)), ("up", (X, F, E)),
                                                                    ("down", (X, E, F)))}
    act, lim = _act(hp.clamp_exp[il])
    y = B.moe(b, z, router, exps["gate"], exps["up"], exps["down"], hp.n_used, scales={}, hidden=F, bias=bias,
              gating=hp.gating, normalize=hp.weights_norm, weights_scale=hp.weights_scale, act=act, act_limit=lim)
    return b.add(y, _ffn(b, w, f"{p}.ffn", "_shexp", z, hp.n_ff_shexp[il], hp.clamp_shexp[il]), "ffn_out")
