"""qwen3next (llama.cpp `src/models/qwen3next.cpp`): the qwen35 hybrid decoder (see `qwen35.py`)
with these differences (docs/arch/qwen-family.md §4, §5):

* delta-net q/k heads are shared *interleaved* (`h // (Hv/Hk)`; GGUF keeps HF's grouped order);
* beta and alpha come from one `ssm_ba` projection grouped per k head as [b | a];
* `attn_qkv` + `attn_gate` (or the legacy fused `ssm_in`, grouped per k head as [q | k | v | z]);
  their `.scale` and `ssm_out.scale` are not honoured;
* plain NEOX rope over the first `rope.dimension_count` dims (partial rotary);
* every layer's FFN is a softmax top-k MoE (merged `ffn_gate_up_exps` or separate gate/up) plus a
  shared expert gated by sigmoid(h @ `ffn_gate_inp_shexp`).
"""

from __future__ import annotations

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from .. import linear_attention as DN
from ..hparams import Keys, ModelError
from . import qwen35

ARCH = "qwen3next"
HParams = qwen35.HParams

FACTS = qwen35.HybridFacts(head_map="interleaved", rope_mode="neox", ba_layout="grouped", linear_scales=False)


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    common = qwen35.read_common(keys, n_vocab)
    n_expert = keys.int("expert_count", 0)
    n_used = keys.int("expert_used_count", 0)
    if n_expert <= 0 or n_used <= 0:
        raise ModelError("qwen3next requires expert_count > 0 and expert_used_count > 0")
    if n_used > n_expert:
        raise ModelError(f"qwen3next: expert_used_count ({n_used}) exceeds expert_count ({n_expert})")
    n_ff_exp = keys.int("expert_feed_forward_length", 0) or common["n_ff"] // n_used
    n_ff_shexp = keys.int("expert_shared_feed_forward_length", 0) or common["n_ff"]
    return HParams(
        **common, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return qwen35.build_hybrid(w, hp, n_ctx, all_logits, FACTS, moe_ffn)


def moe_ffn(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    """Routed experts plus the sigmoid-gated shared expert."""
    E, F, X, Fs = hp.n_embd, hp.n_ff_exp, hp.n_expert, hp.n_ff_shexp
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    gate, up = B.expert_gate_up(w, p, X, F, E)
    down = w.need(f"{p}.ffn_down_exps.weight", (X, E, F))
    scales = {k: w.get(f"{p}.ffn_{k}_exps.scale", (X,), required=False) for k in ("gate", "up", "down")}
    routed = B.moe(b, h, router, gate, up, down, hp.n_expert_used, scales=scales, hidden=F)
    parts = {"gate": (Fs, E), "up": (Fs, E), "down": (E, Fs)}
    mats = {k: w.need(f"{p}.ffn_{k}_shexp.weight", s) for k, s in parts.items()}
    sh_scales = {k: w.get(f"{p}.ffn_{k}_shexp.scale", (1,), required=False) for k in parts}
    shared = B.swiglu_ffn(b, h, mats["gate"], mats["up"], mats["down"], biases={}, scales=sh_scales)
    gate_w = w.need(f"{p}.ffn_gate_inp_shexp.weight", (E,))
    if gate_w.dtype != "float32":
        gate_w = b.dequantize(gate_w, "ffn_gate_inp_shexp.w")
    gated = b.mul(shared, DN.shared_expert_gate(b, h, gate_w), "ffn_shexp_gated")
    return b.add(routed, gated, "ffn_out")
