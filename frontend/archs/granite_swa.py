"""granite_swa (llama.cpp `src/models/granite-swa.cpp`; HF GraniteSWAForCausalLM and
GraniteMoeSWAForCausalLM, both converted to this one architecture): granite's block and multipliers
(frontend/archs/granite.py) with a sliding window on the layers `attention.sliding_window_pattern`
marks (a per-layer array, required), a learned sink logit per head on every layer, rope per layer by
`attention.rope_pattern` (1 = rope, a scalar for every layer, all roped when absent; the global rope
base everywhere; `rope.scaling.finetuned` is not read). Its MoE reads the experts' gate and up from
the merged `ffn_gate_up_exps` (or separate tensors) and the shared expert's from one fused
`ffn_up_shexp` [2 Fs, E], gate first."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError
from . import granite

ARCH = "granite_swa"


@dataclass(frozen=True)
class HParams(granite.HParams):
    window: int
    swa: tuple[bool, ...]  # per layer: attends through the window
    roped: tuple[bool, ...]  # per layer: rope (else NoPE)


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    base = granite.read_granite_hparams(keys, n_vocab, finetuned_key=False)
    window = keys.int("attention.sliding_window")
    if window <= 0:
        raise ModelError(f"granite_swa requires attention.sliding_window > 0, got {window}")
    return HParams(**dataclasses.asdict(base), window=window,
                   swa=_per_layer(keys, "attention.sliding_window_pattern", base.n_layer, None),
                   roped=_per_layer(keys, "attention.rope_pattern", base.n_layer, True))


def _per_layer(keys: Keys, key: str, n_layer: int, default: bool | None) -> tuple[bool, ...]:
    """A per-layer flag array (llama.cpp's get_key_or_arr: a scalar applies to every layer);
    `default` None: the key is required and must be an array, as llama.cpp's get_arr reads it."""
    raw = keys.raw(key, default)
    if raw is None or (default is None and not isinstance(raw, list)):
        raise ModelError(f"granite_swa requires {keys.arch}.{key} as a per-layer array")
    if not isinstance(raw, list):
        return (bool(raw),) * n_layer
    if len(raw) != n_layer:
        raise ModelError(f"key {keys.arch}.{key} has {len(raw)} entries, expected {n_layer} (one per layer)")
    return tuple(bool(v) for v in raw)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    def attention(il: int) -> granite.LayerAttention:
        return granite.LayerAttention(roped=hp.roped[il], window=hp.window if hp.swa[il] else 0, sinks=True)

    return granite.build_granite(w, hp, n_ctx, all_logits, attention, _ffn)


def _ffn(w: B.Weights, hp: granite.HParams, p: str, h: Value) -> Value:
    return _moe(w, hp, p, h) if hp.n_expert else granite.dense_ffn(w, hp, p, h)


def _moe(w: B.Weights, hp: granite.HParams, p: str, h: Value) -> Value:
    b, E, F, X = w.b, hp.n_embd, hp.n_ff, hp.n_expert
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    gate, up = B.expert_gate_up(w, p, X, F, E)
    down = w.need(f"{p}.ffn_down_exps.weight", (X, E, F))
    w.ignore(*(f"{p}.ffn_{k}_exps.scale" for k in ("gate_up", "gate", "up", "down")))
    y = B.moe(b, h, router, gate, up, down, hp.n_expert_used, scales={}, hidden=F)
    if not hp.n_ff_shexp:
        return y
    return b.add(y, _fused_shared_expert(w, hp, p, h), "ffn_moe_shexp_out")


def _fused_shared_expert(w: B.Weights, hp: granite.HParams, p: str, h: Value) -> Value:
    """down(swiglu([gate | up] = W_up h)): llama.cpp's ggml_swiglu on the fused row."""
    b, E, Fs = w.b, hp.n_embd, hp.n_ff_shexp
    fused = b.matmul(h, w.need(f"{p}.ffn_up_shexp.weight", (2 * Fs, E)), "ffn_shexp_gate_up")
    w.ignore(*(f"{p}.ffn_{k}_shexp.scale" for k in ("up", "down")))
    g = b.slice(fused, 1, 0, Fs, "ffn_shexp_gate")
    u = b.slice(fused, 1, Fs, 2 * Fs, "ffn_shexp_up")
    act = B.silu_mul(b, g, u, "ffn_shexp_act")
    return b.matmul(act, w.need(f"{p}.ffn_down_shexp.weight", (E, Fs)), "ffn_shexp_down")
