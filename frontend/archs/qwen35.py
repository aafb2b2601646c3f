"""qwen35 (llama.cpp `src/models/qwen35.cpp`): a hybrid of gated delta-net linear-attention layers
and gated full-attention layers (IMROPE, per-head q/k RMSNorm, q projection holding a sigmoid
output gate), post-attention norm before a dense SwiGLU FFN.

Facts (docs/arch/qwen-family.md §4, §5): q/k heads are shared with the value heads *tiled*
(`h % Hk`, the converter reorders v heads for it); the delta-net output gate is silu(z); text
positions are (p, p, p, 0) under the IMROPE sections; every `.scale` of the linear layer's
projections (`attn_qkv`, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_out`), of attention and of the
FFN is honoured. `build_hybrid` is shared with qwen3next, which differs only in the facts of
`HybridFacts` and its MoE FFN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from .. import linear_attention as DN
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table

ARCH = "qwen35"


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int  # executed layers (block_count - nextn_predict_layers)
    n_layer_all: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    eps: float
    rope_base: float
    freq_scale: float
    n_ctx_train: int
    recurrent: tuple[bool, ...]
    ssm: DN.DeltaNetDims
    rope_sections: tuple[int, ...] = ()
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0


@dataclass(frozen=True)
class HybridFacts:
    """What differs between the hybrid delta-net architectures built by `build_hybrid`."""

    head_map: str  # delta-net q/k head sharing: "tiled" or "interleaved"
    rope_mode: str  # "imrope" or "neox"
    ba_layout: str  # "split" (ssm_beta + ssm_alpha) or "grouped" (ssm_ba)
    linear_scales: bool  # honour attn_qkv/attn_gate/ssm_beta/ssm_alpha/ssm_out `.scale`
    gate_act: str = "silu"  # delta-net output gate


FACTS = HybridFacts(head_map="tiled", rope_mode="imrope", ba_layout="split", linear_scales=True)

FFN = Callable[[GraphBuilder, B.Weights, HParams, str, Value], Value]


def read_common(keys: Keys, n_vocab: int) -> dict:
    n_embd = keys.int("embedding_length")
    n_head = keys.int("attention.head_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    if keys.int("attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{keys.arch} requires attention.value_length == attention.key_length ({head_dim})")
    n_rot = keys.int("rope.dimension_count", head_dim)
    if not 0 < n_rot <= head_dim or n_rot % 2:
        raise ModelError(
            f"{keys.arch}: rope.dimension_count ({n_rot}) must be even and at most the head dim ({head_dim})"
        )
    n_layer_all = keys.int("block_count")
    nextn = keys.int("nextn_predict_layers", 0)
    if not 0 <= nextn < n_layer_all:
        raise ModelError(
            f"{keys.arch}: nextn_predict_layers ({nextn}) must be below block_count ({n_layer_all})"
        )
    n_layer = n_layer_all - nextn
    ssm = DN.read_delta_net_dims(keys)
    return dict(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_layer_all=n_layer_all,
        n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_rot=n_rot,
        n_ff=keys.int("feed_forward_length", 0),
        eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0),
        freq_scale=rope_freq_scale(keys),
        n_ctx_train=keys.int("context_length"),
        recurrent=DN.recurrent_layers(keys, n_layer_all, n_layer),
        ssm=ssm,
    )


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    common = read_common(keys, n_vocab)
    if keys.int("expert_count", 0):
        raise ModelError("qwen35 is dense: expert_count must be 0")
    sections = keys.raw("rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) != 4:
        raise ModelError("missing required key qwen35.rope.dimension_sections (4 section sizes)")
    sections_t = tuple(int(s) for s in sections)
    if sum(sections_t) > common["head_dim"]:
        raise ModelError(f"qwen35: rope.dimension_sections {list(sections_t)} sum past the head dim")
    return HParams(**common, rope_sections=sections_t)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return build_hybrid(w, hp, n_ctx, all_logits, FACTS, dense_ffn)


# ---------------------------------------------------------------------------------------------
# the hybrid decoder (qwen35, qwen3next)


def build_hybrid(
    w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool, facts: HybridFacts, ffn: FFN
) -> Graph:
    b, E = w.b, hp.n_embd
    sections = hp.rope_sections if facts.rope_mode == "imrope" else None
    inp = B.decoder_inputs(w, hp.n_vocab, E, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, None, sections)))
    new_state: dict[str, Value] = {}

    def layer(il: int, x: Value) -> Value:
        h = B.rms_norm(b, x, w.need(f"blk.{il}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
        if hp.recurrent[il]:
            y = linear_attention_layer(b, w, hp, facts, il, h, new_state)
        else:
            y = _full_attention(b, w, hp, facts, il, h, inp.pos, inp.table, n_ctx, new_state)
        x = b.add(x, y, "attn_residual")
        h = B.rms_norm(b, x, w.need(f"blk.{il}.post_attention_norm.weight", (E,)), hp.eps, "attn_post_norm")
        return b.add(x, ffn(b, w, hp, f"blk.{il}", h), "l_out")

    x = B.layers(b, hp.n_layer, inp.x, layer)
    skip_mtp_layers(w, hp)
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, E, hp.eps), output_scale=True)


class HasMtpLayers(Protocol):
    @property
    def n_layer(self) -> int: ...
    @property
    def n_layer_all(self) -> int: ...


def skip_mtp_layers(w: B.Weights, hp: HasMtpLayers) -> None:
    """MTP (nextn) blocks are loaded by llama.cpp but not run in the main pass."""
    prefixes = tuple(f"blk.{il}." for il in range(hp.n_layer, hp.n_layer_all))
    if prefixes:
        w.used.update(n for n in w.model.tensors if n.startswith(prefixes))


def proj(
    w: B.Weights,
    b: GraphBuilder,
    x: Value,
    name: str,
    n_out: int,
    n_in: int,
    *,
    scale: bool | None,
    bias: bool = False,
    short: str | None = None,
) -> Value:
    """x @ W.T [* s] [+ b]. `scale`: True honours an optional `.scale`; False loads and ignores one
    (llama.cpp creates it but the graph does not read it); None: the arch has no such tensor."""
    weight = w.need(f"{name}.weight", (n_out, n_in))
    s = w.get(f"{name}.scale", (1,), required=False) if scale is not None else None
    bv = w.get(f"{name}.bias", (n_out,), required=False) if bias else None
    return B.linear(b, x, weight, short or name.split(".")[-1], bias=bv, scale=s if scale else None)


def linear_attention_layer(
    b: GraphBuilder,
    w: B.Weights,
    hp: HParams,
    facts: HybridFacts,
    il: int,
    h: Value,
    new_state: dict[str, Value],
) -> Value:
    """One gated delta-net layer from its normed input `h` (qkv/z, beta/alpha, the recurrence,
    the output projection); qwen3next and qwen4exp run the same layer."""
    E, dims = hp.n_embd, hp.ssm
    p = f"blk.{il}"
    sc = facts.linear_scales
    if w.has(f"{p}.attn_qkv.weight"):
        qkv = proj(w, b, h, f"{p}.attn_qkv", dims.conv_channels, E, scale=sc, short="linear_attn_qkv_mixed")
        z = proj(w, b, h, f"{p}.attn_gate", dims.value_dim, E, scale=sc, short="z")
        if w.has(
            f"{p}.ssm_in.weight"
        ):  # llama.cpp prefers attn_qkv/attn_gate; a legacy ssm_in is loaded unused
            w.used.update(n for n in (f"{p}.ssm_in.weight", f"{p}.ssm_in.scale") if w.has(n))
    elif facts.ba_layout == "grouped" and w.has(f"{p}.ssm_in.weight"):
        qkvz_dim = dims.conv_channels + dims.value_dim
        mixed = proj(w, b, h, f"{p}.ssm_in", qkvz_dim, E, scale=sc, short="linear_attn_mixed_qkvz")
        qkv, z = DN.split_qkvz_legacy(b, dims, mixed)
    else:
        raise ModelError(f"missing tensor {p}.attn_qkv.weight (expected shape {[dims.conv_channels, E]})")
    if facts.ba_layout == "grouped":
        ba = proj(w, b, h, f"{p}.ssm_ba", 2 * dims.n_v_heads, E, scale=None, short="linear_attn_mixed_ba")
        beta_logits, alpha = DN.split_ba_grouped(b, dims, ba)
    else:
        beta_logits = proj(w, b, h, f"{p}.ssm_beta", dims.n_v_heads, E, scale=sc, short="beta")
        alpha = proj(w, b, h, f"{p}.ssm_alpha", dims.n_v_heads, E, scale=sc, short="alpha")
    o = DN.delta_net(
        b,
        dims,
        il,
        qkv,
        z,
        beta_logits,
        alpha,
        conv_w=_need_f32(w, f"{p}.ssm_conv1d.weight", (dims.conv_channels, dims.conv_kernel)),
        dt_bias=_need_f32(w, f"{p}.ssm_dt.bias", (dims.n_v_heads,)),
        ssm_a=_need_f32(w, f"{p}.ssm_a", (dims.n_v_heads,)),
        norm_w=_need_f32(w, f"{p}.ssm_norm.weight", (dims.head_v_dim,)),
        eps=hp.eps,
        head_map=facts.head_map,
        gate_act=facts.gate_act,
        new_state=new_state,
    )
    return proj(w, b, o, f"{p}.ssm_out", E, dims.value_dim, scale=sc, short="linear_attn_out")


def _need_f32(w: B.Weights, name: str, shape: tuple[int, ...]) -> Value:
    v = w.get(name, shape, f32=True)
    assert v is not None
    return v


def _full_attention(
    b: GraphBuilder,
    w: B.Weights,
    hp: HParams,
    facts: HybridFacts,
    il: int,
    h: Value,
    pos: Value,
    table: Value,
    n_ctx: int,
    new_state: dict[str, Value],
) -> Value:
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    p = f"blk.{il}"
    qg = proj(w, b, h, f"{p}.attn_q", 2 * H * D, E, scale=True, bias=True, short="Qcur_full_proj")
    k = proj(w, b, h, f"{p}.attn_k", Hkv * D, E, scale=True, bias=True, short="Kcur_proj")
    v = proj(w, b, h, f"{p}.attn_v", Hkv * D, E, scale=True, bias=True, short="Vcur_proj")
    q, gate = DN.split_q_gate(b, qg, H, D)
    dims = DN.GatedAttentionDims(
        H, Hkv, D, hp.n_rot, facts.rope_mode, hp.rope_sections if facts.rope_mode == "imrope" else ()
    )
    a = DN.gated_attention(
        b,
        dims,
        il,
        q,
        gate,
        k,
        v,
        q_norm=w.need(f"{p}.attn_q_norm.weight", (D,)),
        k_norm=w.need(f"{p}.attn_k_norm.weight", (D,)),
        eps=hp.eps,
        pos=pos,
        rope_table=table,
        n_ctx=n_ctx,
        new_state=new_state,
    )
    return proj(w, b, a, f"{p}.attn_output", E, H * D, scale=True, short="attn_output")


def dense_ffn(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    return B.scaled_swiglu_ffn(w, p, h, hp.n_embd, hp.n_ff)
