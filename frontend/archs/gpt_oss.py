"""gpt-oss (llama.cpp `src/models/openai-moe.cpp`, arch LLM_ARCH_OPENAI_MOE): q/k/v/o with biases
and `.scale`s, NEOX rope with YaRN keeping its magnitude (1 + 0.1 ln F on q and k), attention with
a learned sink logit per head and a sliding window on the layers `sliding_window_pattern` marks
(every even one by default), `post_attention_norm` before the MoE, a router with a bias, top-k on
the raw logits then a softmax over the k chosen, experts with biases and `swiglu_oai` spelled
with ggml's single division; the output matrix is never tied. The expert `.scale`s are loaded
and not read, as llama.cpp does."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value
from ggufc.ir.moe_routing_spelled import expert_act_spelled, topk_softmax_spelled

from .. import blocks as B
from ..hparams import Keys, ModelError, RopeScaling, read_rope_scaling, scaled_rope_table, swa_layers

ARCH = "gpt-oss"


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # = rope.dimension_count: llama.cpp sizes the heads by n_rot
    n_ff_exp: int
    eps: float
    rope_base: float
    rope_base_swa: float
    rope: RopeScaling
    window: int
    swa: tuple[bool, ...]
    n_expert: int
    n_expert_used: int
    n_ctx_train: int


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_head, n_layer = keys.int("embedding_length"), keys.int("attention.head_count"), keys.int("block_count")
    n_rot = keys.int("rope.dimension_count", keys.int("attention.key_length", n_embd // n_head))
    for key in ("attention.key_length", "attention.value_length"):
        if keys.int(key, n_rot) != n_rot:
            raise ModelError(f"gpt-oss requires {key} ({keys.int(key)}) == rope.dimension_count ({n_rot})")
    n_expert, n_used = keys.int("expert_count", 0), keys.int("expert_used_count", 0)
    if not 0 < n_used <= n_expert:
        raise ModelError(f"gpt-oss requires 0 < expert_used_count ({n_used}) <= expert_count ({n_expert})")
    window = keys.int("attention.sliding_window")
    if window <= 0:
        raise ModelError(f"gpt-oss requires attention.sliding_window > 0, got {window}")
    rope_base = keys.float("rope.freq_base", 10000.0)
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head), head_dim=n_rot,
        n_ff_exp=keys.int("expert_feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=rope_base, rope_base_swa=keys.float("rope.freq_base_swa", rope_base),
        rope=read_rope_scaling(keys), window=window, swa=tuple(swa_layers(keys, n_layer, 2)),
        n_expert=n_expert, n_expert_used=n_used, n_ctx_train=keys.int("context_length"),
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", scaled_rope_table(n_ctx, hp.head_dim, hp.rope_base, hp.rope, None)))
    tables = {False: inp.table, True: inp.table}
    if any(hp.swa) and hp.rope_base_swa != hp.rope_base:
        tables[True] = w.add_derived("rope_table_swa", scaled_rope_table(n_ctx, hp.head_dim, hp.rope_base_swa,
                                                                         hp.rope, None))
    w.need("output.weight", (hp.n_vocab, hp.n_embd))  # never tied to token_embd in llama.cpp
    new_state: dict[str, Value] = {}
    x = B.layers(b, hp.n_layer, inp.x,
                 lambda il, x: _layer(b, w, hp, il, x, inp.pos, tables[hp.swa[il]], n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int) -> Value:
    """build_qkv / build_attn's projection: (W x) * s + b."""
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False)
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, _proj(w, b, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, b, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, b, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    q = B.rope(b, q, pos, table, "neox", D, "Qrope")
    k = B.rope(b, k, pos, table, "neox", D, "Krope")
    sinks = w.need(f"{p}.attn_sinks.weight", (H,))
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il,
                    window=hp.window if hp.swa[il] else 0, sinks=sinks)
    o = _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D)
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.post_attention_norm.weight", (E,)), hp.eps, "attn_post_norm")
    return b.add(x, moe_ffn(b, w, hp, p, h), "l_out")


def moe_ffn(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    """build_moe_ffn with LLM_EXPERT_GATING_FUNC_SOFTMAX_WEIGHT: logits = W_r h + b_r; the k
    largest logits (descending), their softmax as the weights; each chosen expert's
    down(swiglu_oai(gate h + b_g, up h + b_u)) + b_d, summed weighted in selection order."""
    E, F, X, k = hp.n_embd, hp.n_ff_exp, hp.n_expert, hp.n_expert_used
    t = h.shape[0]
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    logits = b.matmul(h, router, "ffn_moe_logits.mm")
    names = {"biased": "ffn_moe_logits", "topk": "ffn_moe_topk", "ids": "ffn_moe_ids", "weights": "ffn_moe_weights"}
    weights, ids = topk_softmax_spelled(b, logits, k, "ffn_moe", w.need(f"{p}.ffn_gate_inp.bias", (X,)), names)
    w.ignore(*(f"{p}.ffn_{kind}_exps.scale" for kind in ("gate", "up", "down")))
    h3 = b.reshape(h, (t, 1, E), "ffn_moe_in")

    def experts(inp: Value, kind: str, n_out: int, n_in: int) -> Value:
        wq = w.need(f"{p}.ffn_{kind}_exps.weight", (X, n_out, n_in))
        wf = b.dequantize(wq, f"ffn_moe_{kind}.w") if wq.dtype != "float32" else wq
        y = b.emit("matmul_id", [inp, wf, ids], O.NoAttrs(), f"ffn_moe_{kind}")
        bias = b.gather(w.need(f"{p}.ffn_{kind}_exps.bias", (X, n_out)), ids, f"ffn_moe_{kind}_bias")
        return b.add(y, bias, f"ffn_moe_{kind}_biased")

    act = expert_act_spelled(b, experts(h3, "gate", F, E), experts(h3, "up", F, E), "swiglu_oai", 0.0, "ffn_moe_act")
    down = experts(act, "down", E, F)
    weighted = b.mul(down, b.reshape(weights, (t, k, 1), "ffn_moe_weights3"), "ffn_moe_weighted")
    return b.reduce("sum", weighted, "ffn_moe_out", axis=1, keepdims=False)
