"""kimi-k3 (llama.cpp `src/models/kimi-k3.cpp`; docs/arch/deepseek-glm-minimax-kimi-hy.md §5).

A hybrid of KDA linear-attention layers (`head_count_kv` 0 for the layer: the delta rule with a
decay per key index, frontend/linear_attention.py `kda`) and MLA layers without any rope, their heads'
output times sigmoid(normed input @ attn_gate) (frontend/latent_attention.py). Cross-layer residual
attention (`attn_res.block_size` bs > 0): every bs-th layer banks its raw input and restarts the
residual from its attention output; before the attention, the FFN and the output norm the stream
is replaced by a softmax mix of the bank and itself (frontend/hyper_connections.py). Leading dense blocks
are situ FFNs, the others a latent MoE (router on the full width, experts in
`expert_latent_length` dims between `ffn_routed_down` and `ffn_routed_up`, optional routed norm,
sigmoid gating with selection bias) plus a situ shared expert. llama.cpp reads none of the
`.scale` tensors nor the KDA q/k/v biases this architecture may carry.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError
from ..hyper_connections import residual_attention_mix
from ..latent_attention import MlaDims, check_dims, low_rank_q, mla_attention
from ..linear_attention import KdaDims, KdaWeights, kda, kda_conv_kernel

ARCH = "kimi-k3"
SIGMOID = 2  # expert_gating_func


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    eps: float
    kda_layers: tuple[bool, ...]  # head_count_kv == 0
    mla: MlaDims
    kda: KdaDims
    res_block: int  # attn_res.block_size (0: no residual attention)
    n_lead_dense: int
    n_ff: int
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_latent: int  # 0: the experts run in the model width
    weights_norm: bool
    weights_scale: float
    situ_beta: float
    situ_linear_beta: float


def _first(keys: Keys, name: str) -> int:
    """A key that may be per layer where llama.cpp reads only element 0."""
    v = keys.raw(name)
    if isinstance(v, list):
        if not v:
            raise ModelError(f"key {ARCH}.{name} is an empty array")
        return int(v[0])
    return keys.int(name)


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_layer = keys.int("block_count")
    if keys.int("nextn_predict_layers", 0):
        raise ModelError(f"{ARCH}: multi-token prediction layers (nextn_predict_layers) are not supported yet")
    if keys.int("expert_gating_func") != SIGMOID:
        raise ModelError(f"{ARCH}: expert_gating_func {keys.int('expert_gating_func')} is not supported (only 2, "
                         "sigmoid)")
    if keys.int("expert_group_count", 0) > 1:
        raise ModelError(f"{ARCH}: grouped expert selection (expert_group_count > 1) is not supported yet")
    n_head = _first(keys, "attention.head_count")
    kv = keys.per_layer("attention.head_count_kv", n_layer)
    n_rot, key_mla = keys.int("rope.dimension_count"), keys.int("attention.key_length_mla")
    kv_lora = keys.int("attention.kv_lora_rank")
    mla = MlaDims(n_head, keys.int("attention.q_lora_rank", 0), kv_lora, n_rot, key_mla - n_rot,
                  keys.int("attention.value_length_mla"))
    if any(kv):
        check_dims(dataclasses.replace(mla, q_lora=max(mla.q_lora, 1)), keys.int("attention.key_length"), kv_lora,
                   ARCH)
    lb = keys.float("kda.gate_lower_bound", -math.inf)
    kdims = KdaDims(n_head, keys.int("kda.head_dim"), keys.int("ssm.conv_kernel"), None if lb == -math.inf else lb)
    if not all(kv) and (kdims.head_dim <= 0 or kdims.conv_kernel < 2):
        raise ModelError(f"{ARCH}: kda.head_dim must be positive and ssm.conv_kernel at least 2")
    n_expert, n_used = keys.int("expert_count"), keys.int("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise ModelError(f"{ARCH}: needs 0 < expert_used_count ({n_used}) <= expert_count ({n_expert})")
    n_ff_exp = _first(keys, "expert_feed_forward_length")
    scale = keys.float("expert_weights_scale", 0.0)
    return HParams(
        n_vocab=n_vocab, n_embd=keys.int("embedding_length"), n_layer=n_layer, n_ctx_train=keys.int("context_length"),
        eps=keys.float("attention.layer_norm_rms_epsilon"), kda_layers=tuple(k == 0 for k in kv), mla=mla,
        kda=kdims, res_block=keys.int("attn_res.block_size"), n_lead_dense=keys.int("leading_dense_block_count", 0),
        n_ff=keys.int("feed_forward_length", 0), n_expert=n_expert, n_used=n_used, n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_exp * max(keys.int("expert_shared_count"), 1), n_latent=keys.int("expert_latent_length", 0),
        weights_norm=bool(keys.raw("expert_weights_norm", False)),
        weights_scale=scale if scale not in (0.0, 1.0) else 1.0,  # llama.cpp skips 0 and 1
        situ_beta=keys.float("activation.situ_beta"), situ_linear_beta=keys.float("activation.situ_linear_beta"))


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    # no rope anywhere: the decoder's table is an empty constant nothing reads
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived("rope_table", np.zeros((1, 2))))
    new_state: dict[str, Value] = {}
    bank: list[Value] = []
    w.used.update(n for n in w.model.tensors if n.endswith(".scale"))  # llama.cpp never applies them

    def layer(il: int, x: Value) -> Value:
        return _layer(b, w, hp, il, x, inp.pos, n_ctx, new_state, bank)

    x = B.layers(b, hp.n_layer, inp.x, layer)
    if hp.res_block:
        x = residual_attention_mix(b, bank, x, w.need("output_res_score.weight", (hp.n_embd,)), hp.eps, "res_final")
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, n_ctx: int,
           new_state: dict[str, Value], bank: list[Value]) -> Value:
    E, p = hp.n_embd, f"blk.{il}"

    def mix(stream: Value, which: str) -> Value:
        if not hp.res_block:
            return stream
        return residual_attention_mix(b, bank, stream, w.need(f"{p}.{which}_res_score.weight", (E,)), hp.eps,
                                      f"{which}_res_mix")

    cur = mix(x, "attn")
    banked = hp.res_block > 0 and il % hp.res_block == 0
    if banked:
        bank.append(x)  # the raw layer input, after this layer's mix
    h = B.rms_norm(b, cur, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    a = _kda_layer(b, w, hp, il, h, new_state) if hp.kda_layers[il] else _mla_layer(b, w, hp, il, h, pos, n_ctx,
                                                                                     new_state)
    x = a if banked else b.add(x, a, "prefix_sum_attn")
    z = B.rms_norm(b, mix(x, "ffn"), w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    f = _situ_ffn(b, w, hp, f"{p}.ffn", "", z, hp.n_ff) if il < hp.n_lead_dense else _latent_moe(b, w, hp, p, z)
    return b.add(x, f, "l_out")


def _kda_layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, new_state: dict[str, Value]) -> Value:
    E, p, d = hp.n_embd, f"blk.{il}", hp.kda
    H, D, inner = d.n_head, d.head_dim, d.inner
    w.used.update(f"{p}.attn_{k}.bias" for k in "qkv" if w.has(f"{p}.attn_{k}.bias"))  # loaded, never read
    wt = KdaWeights(
        q=w.need(f"{p}.attn_q.weight", (inner, E)), k=w.need(f"{p}.attn_k.weight", (inner, E)),
        v=w.need(f"{p}.attn_v.weight", (inner, E)),
        conv=(kda_conv_kernel(w, f"{p}.ssm_conv1d_q.weight", d), kda_conv_kernel(w, f"{p}.ssm_conv1d_k.weight", d),
              kda_conv_kernel(w, f"{p}.ssm_conv1d_v.weight", d)),
        f_a=w.need(f"{p}.ssm_f_a.weight", (D, E)), f_b=w.need(f"{p}.ssm_f_b.weight", (inner, D)),
        dt_bias=w.need(f"{p}.ssm_dt.bias", (inner,)),
        ssm_a=b.reshape(w.need(f"{p}.ssm_a", (H,)), (H, 1), "ssm_a_heads"),
        beta=B.per_head_rows(w, f"{p}.ssm_beta.weight", H, E),
        out_gate=w.need(f"{p}.ssm_g.weight", (inner, E)), norm=w.need(f"{p}.ssm_norm.weight", (D,)))
    o = kda(b, d, il, h, wt, hp.eps, new_state)
    return B.linear(b, o, w.need(f"{p}.attn_output.weight", (E, inner)), "kda_out")


def _mla_layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, pos: Value, n_ctx: int,
               new_state: dict[str, Value]) -> Value:
    E, p, dims = hp.n_embd, f"blk.{il}", hp.mla
    if w.has(f"{p}.attn_q_a_norm.weight"):
        qr = low_rank_q(b, w, p, h, dims, hp.eps)
    else:
        dims = dataclasses.replace(dims, q_lora=0)
        qr = h
    gate_w = w.get(f"{p}.attn_gate.weight", (dims.n_head * dims.v_head, E), required=False)
    gate = B.linear(b, h, gate_w, "mla_gate") if gate_w is not None else None
    return mla_attention(b, w, p, il, h, qr, dims, hp.eps, pos, None, n_ctx, 1.0 / math.sqrt(dims.key_dim),
                         new_state, None, out_gate=gate, output_scale=False)


def _situ_ffn(b: GraphBuilder, w: B.Weights, hp: HParams, prefix: str, suffix: str, x: Value, hidden: int) -> Value:
    E = hp.n_embd
    mats = {k: w.need(f"{prefix}_{k}{suffix}.weight", s)
            for k, s in (("gate", (hidden, E)), ("up", (hidden, E)), ("down", (E, hidden)))}
    return B.shared_ffn(b, x, mats["gate"], mats["up"], mats["down"], scales={}, act="situ",
                        act_limit=hp.situ_beta, act_linear_beta=hp.situ_linear_beta)


def _latent_moe(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, z: Value) -> Value:
    E, X, F = hp.n_embd, hp.n_expert, hp.n_ff_exp
    L = hp.n_latent or E
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    bias = w.need(f"{p}.exp_probs_b.bias", (X,))
    exps = {k: w.need(f"{p}.ffn_{k}_exps.weight", s) for k, s in (("gate", (X, F, L)), ("up", (X, F, L)),
                                                                    ("down", (X, L, F)))}
    latent = None
    if hp.n_latent:
        latent = (w.need(f"{p}.ffn_routed_down.weight", (L, E)), w.get(f"{p}.ffn_routed_norm.weight", (L,),
                                                                        required=False),
                  w.need(f"{p}.ffn_routed_up.weight", (E, L)))
    y = B.moe(b, z, router, exps["gate"], exps["up"], exps["down"], hp.n_used, scales={}, hidden=F, bias=bias,
              gating="sigmoid", normalize=hp.weights_norm, weights_scale=hp.weights_scale, act="situ",
              act_limit=hp.situ_beta, act_linear_beta=hp.situ_linear_beta, latent=latent, latent_norm_eps=hp.eps)
    if not w.has(f"{p}.ffn_gate_shexp.weight"):
        return y
    return b.add(y, _situ_ffn(b, w, hp, f"{p}.ffn", "_shexp", z, hp.n_ff_shexp), "ffn_out")
