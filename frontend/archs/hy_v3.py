"""hy_v3 (llama.cpp `src/models/hy-v3.cpp`): qwen3's block (per-head q/k RMSNorm, full NEOX rope,
optional q/k/v biases and `.scale`s) with, on the layers that have a router, a sigmoid-gated MoE
whose experts are picked by probs + `exp_probs_b` (stored without `.bias`) while the weights are
the unbiased probs, plus an always-active (ungated) shared expert; a layer without
`ffn_gate_inp` is a dense SwiGLU block (leading dense blocks are found by tensor presence,
`leading_dense_block_count` is not read). The optional MTP block is not built.
"""

from __future__ import annotations

import dataclasses

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError
from . import llama, qwen3

ARCH = "hy_v3"

# llama.cpp's expert_gating_func values (0 = unset: hy_v3 defaults to sigmoid)
GATINGS = {0: "sigmoid", 1: "softmax", 2: "sigmoid", 4: "sqrt_softplus"}


@dataclasses.dataclass(frozen=True)
class HParams(llama.HParams):
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    gating: str = "sigmoid"
    weights_norm: bool = False
    weights_scale: float = 1.0


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    base = llama.read_hparams(keys, n_vocab)
    if base.n_expert <= 0 or not 0 < base.n_expert_used <= base.n_expert:
        raise ModelError("hy_v3 requires expert_count > 0 and 0 < expert_used_count <= expert_count")
    if keys.int("expert_group_count", 0) > 1:
        raise ModelError("hy_v3: grouped expert selection (expert_group_count > 1) is not supported yet")
    if keys.int("nextn_predict_layers", 0) > 0:
        raise ModelError("hy_v3: the MTP (nextn) block is not supported yet")
    func = keys.int("expert_gating_func", 0)
    if func not in GATINGS:
        raise ModelError(f"hy_v3: expert_gating_func {func} is not supported (known: 1 softmax, 2 sigmoid, "
                         "4 sqrt-softplus)")
    norm = keys.raw("expert_weights_norm", False)
    if not isinstance(norm, bool):
        raise ModelError(f"key hy_v3.expert_weights_norm must be a bool, got {type(norm).__name__}")
    n_ff_exp = keys.int("expert_feed_forward_length")
    scale = keys.float("expert_weights_scale", 0.0)
    return HParams(**dataclasses.asdict(base), n_ff_exp=n_ff_exp,
                   n_ff_shexp=keys.int("expert_shared_feed_forward_length", 0) or n_ff_exp,
                   gating=GATINGS[func], weights_norm=norm,
                   weights_scale=scale if scale not in (0.0, 1.0) else 1.0)  # llama.cpp skips 0 and 1


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return qwen3.build_decoder(w, hp, n_ctx, all_logits, ffn=ffn)


def ffn(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    if not w.has(f"{p}.ffn_gate_inp.weight"):
        return qwen3.dense_ffn(b, w, hp, p, h)
    # llama.cpp loads a MoE layer's dense FFN tensors (they are optional) and never reads them
    w.used.update(n for n in w.model.tensors if n.startswith((f"{p}.ffn_gate.", f"{p}.ffn_up.", f"{p}.ffn_down.")))
    return b.add(_routed(b, w, hp, p, h), _shared(b, w, hp, p, h), "ffn_out")


def _routed(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    E, F, X = hp.n_embd, hp.n_ff_exp, hp.n_expert
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    bias = w.get(f"{p}.exp_probs_b", (X,), required=False, f32=True)
    gate, up = B.expert_gate_up(w, p, X, F, E)
    down = w.need(f"{p}.ffn_down_exps.weight", (X, E, F))
    scales = {k: w.get(f"{p}.ffn_{k}_exps.scale", (X,), required=False) for k in ("gate", "up", "down")}
    return B.moe(b, h, router, gate, up, down, hp.n_expert_used, scales=scales, hidden=F, bias=bias,
                 gating=hp.gating, normalize=hp.weights_norm, weights_scale=hp.weights_scale)


def _shared(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    E, Fs = hp.n_embd, hp.n_ff_shexp
    parts = {"gate": (Fs, E), "up": (Fs, E), "down": (E, Fs)}
    if not all(w.has(f"{p}.ffn_{k}_shexp.weight") for k in parts):
        raise ModelError(f"hy_v3: MoE layer {p} needs ffn_gate_shexp, ffn_up_shexp and ffn_down_shexp")
    mats = {k: w.need(f"{p}.ffn_{k}_shexp.weight", s) for k, s in parts.items()}
    scales = {k: w.get(f"{p}.ffn_{k}_shexp.scale", (1,), required=False) for k in parts}
    return B.shared_ffn(b, h, mats["gate"], mats["up"], mats["down"], scales=scales)
