"""The shapes of a test fixture: its size, its options, and the record of one tensor it writes
(shared by the fixture writer and its per-family keys)."""

from __future__ import annotations

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
    # how its values are drawn and stored: "matrix" (quantizable), "router", "bias", "conv", "norm",
    # "scale", "rope_freqs", "selection_bias", "ssm_a" (negative decay rates), "expert_ids" (I32),
    # "f32" (read as F32 only)
    kind: str


SIZES: dict[str, FixtureSize] = {
    # every row length a multiple of 32: the 32-element block formats quantize every matrix
    "tiny": FixtureSize(),
    # odd dims (3 heads sharing 1 kv head, odd vocab); rows not a multiple of 32 stay F32
    "odd": FixtureSize(vocab=61, n_embd=48, n_layer=2, n_head=3, n_head_kv=1, head_dim=16, n_ff=80,
                       n_expert=3, n_expert_used=2, n_ctx=48),
    # rows a multiple of 256, so the 256-element block types (K-quants, IQ4_XS) apply to every matrix
    "kquant": FixtureSize(vocab=64, n_embd=256, n_layer=1, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                          n_expert=4, n_expert_used=2, n_ctx=32),
    # a GPT-2 byte-level vocabulary needs at least 256 byte tokens plus one special token
    "bpe": FixtureSize(vocab=320),
}
