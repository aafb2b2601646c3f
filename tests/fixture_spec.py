"""The shapes of a test fixture: its size, its options, and the tensors it plans (shared by the
fixture writer and its per-family tensor plans)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class FixtureSize:
    vocab: int = 64
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 96
    n_expert: int = 4
    n_expert_used: int = 2
    n_ctx: int = 64


def resolve_size(size: str | FixtureSize) -> FixtureSize:
    if isinstance(size, FixtureSize):
        return size
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown fixture size {size!r} (have {', '.join(SIZES)})") from None


@dataclass(frozen=True)
class FixtureOptions:
    biases: bool = False  # q/k/v/o biases (and dense FFN biases where the arch has them)
    scales: bool = False  # per-tensor `.scale` [1] on projections, per-expert `_exps.scale` [X]
    rope_freqs: bool = False  # llama's rope_freqs.weight
    tied_output: bool = False  # no output.weight: logits reuse token_embd
    moe: bool | None = None  # None: the architecture's default (MoE only where it is required)
    expert_gate: bool = True  # False: gate-less experts (llama only)
    rope_scaling: float | None = None  # linear rope.scaling.factor
    tokenizer: str = "none"  # "none" or "gpt2"
    chat_template: str | None = None
    rms_eps: float = 1e-5
    rope_base: float = 10000.0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order
    kind: str  # "matrix" (quantizable), "router", "bias", "norm", "scale", "rope_freqs",


def linear(name: str, shape: tuple[int, int], *, bias: bool, scale: bool) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", shape, "matrix")
    if bias:
        yield TensorSpec(f"{name}.bias", (shape[0],), "bias")
    if scale:
        yield TensorSpec(f"{name}.scale", (1,), "scale")


SIZES: dict[str, FixtureSize] = {
    # every row length a multiple of 32: the 32-element block formats quantize every matrix
    "tiny": FixtureSize(),
    # odd dims (3 heads sharing 1 kv head, odd vocab); rows not a multiple of 32 stay F32
    "odd": FixtureSize(vocab=61, n_embd=48, n_layer=2, n_head=3, n_head_kv=1, head_dim=16, n_ff=80,
                       n_expert=3, n_expert_used=2, n_ctx=48),
    # rows a multiple of 256, so the K-quants (Q4_K, Q5_K, Q6_K) apply to every matrix
    "kquant": FixtureSize(vocab=64, n_embd=256, n_layer=1, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                          n_expert=4, n_expert_used=2, n_ctx=32),
    # a GPT-2 byte-level vocabulary needs at least 256 byte tokens plus one special token
    "bpe": FixtureSize(vocab=320),
}


def merged_moe_with_shared_expert(n_expert: int, n_embd: int, n_ff: int, scales: bool) -> Iterator[TensorSpec]:
    """A sigmoid-gated shared expert beside routed experts whose gate and up are one merged tensor."""
    X, E, F = n_expert, n_embd, n_ff
    yield TensorSpec("ffn_gate_inp.weight", (X, E), "router")
    yield TensorSpec("ffn_gate_up_exps.weight", (X, 2 * F, E), "matrix")  # merged, as llama.cpp writes it
    yield TensorSpec("ffn_down_exps.weight", (X, E, F), "matrix")
    if scales:
        yield TensorSpec("ffn_down_exps.scale", (X,), "scale")
    yield TensorSpec("ffn_gate_inp_shexp.weight", (E,), "router")
    for name, shape in (("ffn_gate_shexp", (F, E)), ("ffn_up_shexp", (F, E)), ("ffn_down_shexp", (E, F))):
        yield from linear(name, shape, bias=False, scale=scales)


def biased_moe_with_ungated_shared_expert(n_expert: int, n_embd: int, n_ff: int, n_ff_shexp: int, scales: bool
                                          ) -> Iterator[TensorSpec]:
    """Routed experts (merged gate_up) picked by probs + `exp_probs_b` (no `.bias` suffix, as hy_v3
    names it) and an always-active shared expert without a gate."""
    X, E, F, Fs = n_expert, n_embd, n_ff, n_ff_shexp
    yield TensorSpec("ffn_gate_inp.weight", (X, E), "router")
    yield TensorSpec("exp_probs_b", (X,), "selection_bias")
    yield TensorSpec("ffn_gate_up_exps.weight", (X, 2 * F, E), "matrix")
    yield TensorSpec("ffn_down_exps.weight", (X, E, F), "matrix")
    if scales:
        yield TensorSpec("ffn_down_exps.scale", (X,), "scale")
    for name, shape in (("ffn_gate_shexp", (Fs, E)), ("ffn_up_shexp", (Fs, E)), ("ffn_down_shexp", (E, Fs))):
        yield from linear(name, shape, bias=False, scale=scales)
