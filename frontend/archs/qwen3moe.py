"""qwen3moe (llama.cpp `src/models/qwen3moe.cpp`): the qwen3 block with a softmax-routed MoE
FFN (top-k, renormalised weights, no shared expert)."""

from __future__ import annotations

import dataclasses

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError
from . import llama, qwen3

ARCH = "qwen3moe"


@dataclasses.dataclass(frozen=True)
class HParams(llama.HParams):
    n_ff_exp: int = 0


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    base = llama.read_hparams(keys, n_vocab)
    if base.n_expert <= 0 or base.n_expert_used <= 0:
        raise ModelError("qwen3moe requires expert_count > 0 and expert_used_count > 0")
    n_ff_exp = keys.int("expert_feed_forward_length", 0) or base.n_ff // base.n_expert_used
    return HParams(**dataclasses.asdict(base), n_ff_exp=n_ff_exp)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return qwen3.build_decoder(w, hp, n_ctx, all_logits, ffn=moe_ffn)


def moe_ffn(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    E, F, X = hp.n_embd, hp.n_ff_exp, hp.n_expert
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    gate = w.need(f"{p}.ffn_gate_exps.weight", (X, F, E))
    up = w.need(f"{p}.ffn_up_exps.weight", (X, F, E))
    down = w.need(f"{p}.ffn_down_exps.weight", (X, E, F))
    scales = {k: w.get(f"{p}.ffn_{k}_exps.scale", (X,), required=False) for k in ("gate", "up", "down")}
    return B.moe(b, h, router, gate, up, down, hp.n_expert_used, scales=scales, hidden=F)
