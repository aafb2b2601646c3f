"""The closed op set: one record per op (attributes, shape rule, numpy reference, effects).

Primitive ops are the small vocabulary every model is spelled in. Fused ops are named
compositions that passes form and codegen lowers to dedicated kernels; each has a decomposition
into primitives (see `ir/decompose.py`), so the decomposed and fused graphs can be compared.

References take numpy arrays (float32 or float64 inputs give outputs of the same precision) and
a `ctx` dict holding the symbol values (`T`, `P`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .act_quant import ACT_BLOCK, q8_1_sums_ref, quantize_act_ref
from .graph import Dim, Shape, eval_shape
from .hyper_connections import hc_post_ref, hc_pre_ref, res_mix_ref
from .latent_attention import head_matmul_ref
from .linear_attention import (
    gated_delta_net_ref,
    l2_norm_ref,
    lightning_attention_ref,
    rms_norm_gated_ref,
    ssm_conv_ref,
)
from .moe_routing import check_routing, matmul_id_ref, moe_ffn_node_ref, moe_inputs, moe_route_ref, topk_softmax_ref
from .ngram_embedding import ple_hash_ref
from .sparse_indexers import (
    block_mask_ref,
    block_score_ref,
    block_topk_ref,
    compressed_attention_ref,
    compressed_score_ref,
    compressor_pool_ref,
    index_mask_ref,
    indexer_score_ref,
    indexer_topk_ref,
    token_score_ref,
    token_topk_ref,
)

# ----------------------------------------------------------------------------------------------
# attributes (frozen, typed)


@dataclass(frozen=True)
class NoAttrs:
    pass


@dataclass(frozen=True)
class Unary:
    fn: str  # silu sigmoid exp neg sqrt rsqrt relu softplus square tanh recip sign abs round_f16 gelu_tanh_f16


@dataclass(frozen=True)
class Binary:
    fn: str  # add sub mul div max min


@dataclass(frozen=True)
class Scalar:
    fn: str  # add mul max min pow ("x fn c")
    c: float


@dataclass(frozen=True)
class Reduce:
    fn: str  # sum mean max
    axis: int = -1
    keepdims: bool = True


@dataclass(frozen=True)
class QuantizeAct:
    # llama.cpp's activation format: q8_0 (32-value blocks), q8_1 (q8_0 + block sums), q8_K (256),
    # or f16 (each value rounded to half precision, for F16 weights)
    scheme: str = "q8_0"


@dataclass(frozen=True)
class Reshape:
    shape: Shape


@dataclass(frozen=True)
class Transpose:
    perm: tuple[int, ...]


@dataclass(frozen=True)
class Slice:
    axis: int
    start: int
    stop: int


@dataclass(frozen=True)
class Concat:
    axis: int


@dataclass(frozen=True)
class TopK:
    k: int


@dataclass(frozen=True)
class WindowMask:
    """The sliding window's additive mask [T, P+T]: -inf where a token sees a cell `window` or
    more positions back (see `Attention.window`)."""

    window: int
    n: Dim = "T"


@dataclass(frozen=True)
class Tokens:
    """Shape-only attribute for ops whose output length is the call's token count."""

    n: Dim = "T"


@dataclass(frozen=True)
class Softmax:
    axis: int = -1


@dataclass(frozen=True)
class RMSNorm:
    eps: float


@dataclass(frozen=True)
class Int8Matmul:
    """matmul(quantize_act(x, scheme), W), the rounding done by the kernel (passes/fuse_int8.py)."""

    scheme: str  # q8_0, or q8_1 for weights with block minimums


@dataclass(frozen=True)
class GemvGroup:
    """The matmuls of one rounded input as one op: inputs are the prologue's (x; x and gamma for
    "rms_norm"; gate and up for "swiglu"), then `n_weights` weights, then the residual if any."""

    scheme: str
    n_weights: int
    prologue: str = ""  # "", "rms_norm" or "swiglu": what computes the input from the first inputs
    eps: float = 0.0  # the RMSNorm's
    residual: bool = False  # one weight: the output is the matmul plus the last input

    @property
    def n_prologue(self) -> int:
        return 2 if self.prologue else 1


@dataclass(frozen=True)
class Rope:
    """Rotary embedding with a precomputed cos/sin table [n_ctx, n_rot/2, 2] (exact ggml angles).

    "imrope" (interleaved M-RoPE, ggml_rope_multi) pairs halves as "neox"; its table is built with
    `sections` (frontend/hparams.py `rope_table`): each pair reads one position component
    (t, h, w or e), and text tokens sit at (p, p, p, 0), so a pair that falls to "e" is not rotated.
    """

    mode: str  # "norm" (adjacent pairs), "neox" (halves) or "imrope" (halves, sectioned table)
    n_rot: int
    sections: tuple[int, ...] = ()  # imrope: the four section sizes (t, h, w, e)


@dataclass(frozen=True)
class Attention:
    scale: float
    # which cells each query sees beyond causality: "causal" (all earlier cells), "additive"
    # (a fifth input: a [T, P+T] mask added to the scores) or "indices" (a fifth input: [T, W]
    # int32 cell ids, -1 for none; the sparse form, which reads only those cells) or "blocks" (a
    # fifth input: [T, Hkv, K] int32 block ids per KV group, -1 for none, of `block` cells each;
    # the block-sparse form). An "additive" mask may also be [Hkv, T, P+T], one per KV group.
    mask: str = "causal"
    block: int = 0  # cells per block of the "blocks" form
    # calls of fewer tokens than this take llama.cpp's one-row flash-attention path on its CPU
    # backend (K/V read as F16): q rounded to f16, an online softmax over the cells in order and
    # P.V accumulated in an f16 vector (`attention_f16_pv_ref`); 0: never. Causal mask only; the
    # CPU target rounds so, GPU targets accumulate in f32.
    f16_pv_below: int = 0
    # a sliding window (causal form): a query at position p sees cells p - window < j <= p
    # (llama.cpp's STANDARD SWA mask: `window` keys, itself included); 0: every earlier cell
    window: int = 0
    # a tanh softcap on the scores before the scale, c * tanh(s * (1/c)) in float32 (llama.cpp's
    # attn_soft_cap, applied to K.q before soft_max_ext's scale and mask); 0: none
    softcap: float = 0.0
    # a fifth input sinks [H] (causal form): one more logit per query head that joins the softmax's
    # max and denominator and carries no value (ggml_soft_max_ext with sinks; gpt-oss)
    sinks: bool = False


@dataclass(frozen=True)
class MoeRoute:
    """Router probabilities -> (weights [T,k], expert ids [T,k]); inputs (logits[, bias [X]])
    (references and the routing family: moe_routing.py)."""

    k: int
    norm_clamp: float = 6.103515625e-5  # ggml clamps the renormalisation denominator
    normalize: bool = True
    gating: str = "softmax"  # "softmax", "sigmoid" or "sqrt_softplus" (llama.cpp expert_gating_func)
    selection_bias: bool = False  # a second input [X] added to the probabilities to pick the experts only
    weights_scale: float = 1.0  # expert_weights_scale, applied after the normalisation
    # hash routing: the experts are table[token] (inputs table [V, k] int32, tokens [T] int32), not a top-k
    hash_routed: bool = False


@dataclass(frozen=True)
class MoeTopkSoftmax:
    """Router logits [T,X] (+ the router's bias [X] when biased) -> (weights [T,k], expert ids
    [T,k]): the k largest, then a softmax over those k (gpt-oss; moe_routing.py)."""

    k: int
    biased: bool = False


@dataclass(frozen=True)
class MoeFFN:
    """Fused MoE: route + selected experts' SwiGLU FFN + weighted combine."""

    k: int
    normalize: bool = True
    norm_clamp: float = 6.103515625e-5
    has_gate: bool = True
    expert_scales: tuple[str, ...] = ()  # which of ("gate", "up", "down") carry a per-expert scale
    merged_gate_up: bool = False  # one [X, 2F, E] experts tensor in place of gate and up: rows [0,F) gate, [F,2F) up
    shared: bool = False  # + a shared SwiGLU expert scaled by sigmoid(x . gate_inp_shexp) (qwen3next, qwen4exp)
    shared_scales: tuple[str, ...] = ()  # which of the shared expert's ("gate", "up", "down") carry a [1] scale
    # llama.cpp's 8-bit rounding (ir/act_quant.py) of the routed experts' inputs: (gate/up, down);
    # "" keeps float32 (set by the quantize_activations pass)
    act_schemes: tuple[str, str] = ("", "")
    shared_act_schemes: tuple[str, str] = ("", "")  # the same for the shared expert's inputs
    # the routing family (moe_routing.py): gating, selection bias input, weights scale, activations
    gating: str = "softmax"
    selection_bias: bool = False
    weights_scale: float = 1.0
    # routed experts: "swiglu", "swiglu_clamp" / "swiglu_clamp_after" (limit act_limit), "swiglu_oai" or "situ" (beta
    # act_limit, linear beta act_linear_beta)
    act: str = "swiglu"
    act_limit: float = 0.0
    shared_gated: bool = True  # False: the shared expert is always active (no gate_inp_shexp input)
    shared_act: str = "swiglu"
    shared_act_limit: float = 0.0
    # latent MoE (kimi-k3): the experts run in L dims between routed_down [L, E] and routed_up [E, L]
    # (an RMSNorm [L] of the routed sum between them when latent_norm); the router reads x
    latent: bool = False
    latent_norm: bool = False
    latent_norm_eps: float = 0.0
    act_linear_beta: float = 0.0
    shared_act_linear_beta: float = 0.0
    hash_routed: bool = False  # experts = tid2eid[token] (inputs table [V, k] int32, tokens [T] int32)


@dataclass(frozen=True)
class L2Norm:
    """x / sqrt(sum(x^2) + eps) over the last axis (the gated delta-net's q/k norm)."""

    eps: float


@dataclass(frozen=True)
class RMSNormGated:
    """rms_norm(x, eps) * w * act(z): the gated RMSNorm on the delta-net output."""

    eps: float
    act: str = "silu"  # "silu" (qwen3next, qwen35) or "sigmoid" (qwen4exp)


@dataclass(frozen=True)
class SsmConv:
    """Causal depthwise conv with its input history as state; outputs (new_state, y)."""

    dilation: int = 1


@dataclass(frozen=True)
class GatedDeltaNet:
    """The gated delta rule with state [Hv, Dv, Dk]; outputs (new_state, o [T, Hv, Dv])."""

    head_map: str  # which q/k head value head h reads: "tiled" h % Hk or "interleaved" h // (Hv/Hk)
    scale: float  # output scale, 1/sqrt(Dk)
    key_decay: bool = False  # g [T, Hv, Dk]: one decay per key index (KDA) instead of one per head


@dataclass(frozen=True)
class LightningAttention:
    """Linear attention with a fixed decay per head (minimax-01), the call's tokens one block;
    inputs (state [H, Dk, Dv], q [T, H, Dk], k [T, H, Dk], v [T, H, Dv]), outputs (new_state, o [T, H, Dv])."""

    slopes: tuple[float, ...]  # the per-head decay rates (float32 values)
    layer_scale: float  # this layer's multiplier of the rates (a float32 value)


# -- hyper-connections, sparse-attention indexers, n-gram embedding hash (references in -------
# hyper_connections.py, sparse_indexers.py, ngram_embedding.py)


@dataclass(frozen=True)
class HcPre:
    """Hyper-connection pre-mix of the [T, hc, E] streams into a layer input [T, E].

    rule "sigmoid_mean" (qwen4exp): inputs (R, norm [hc,E], down [lr,hc*E], up [hc*E,lr]
    [, inject [hc,hc*E]]); outputs (mixed [T,E][, post [T,hc] = 2*sigmoid(inject(xf)/hc)]).
    rule "sinkhorn" (deepseek4's full-rank mix): inputs (R, fn [(2+hc)*hc, hc*E] (post) or
    [hc, hc*E] (collapse), scale [3] or [1], base like fn's rows); outputs (mixed[, post [T,hc],
    comb [T,hc(src),hc(dst)]]) for an `hc_post` with comb=True.
    """

    n_hc: int
    eps: float
    rule: str = "sigmoid_mean"
    post: bool = True  # False: the final collapse (no inject, no post weights)
    hc_eps: float = 0.0  # "sinkhorn": added to the pre weights and in every normalisation
    n_iter: int = 0  # "sinkhorn": Sinkhorn rounds (the first is the column normalisation alone)


@dataclass(frozen=True)
class HcPost:
    """R [T,hc,E] + post [T,hc] * y [T,E] per stream (comb=True: R mixed by a [T,hc(src),hc(dst)] comb)."""

    comb: bool = False


@dataclass(frozen=True)
class ResMix:
    """Cross-layer residual attention: (src [T,n,E] banked inputs, cur [T,E], score weight [E]) ->
    softmax-of-(sum(rms(x) * w)) mix of the raw src rows and cur [T,E]."""

    eps: float


@dataclass(frozen=True)
class IndexerScore:
    """QSA block scores: inputs (q [T,Hi,Di] normed+roped, raw key cache [C,Di], k-norm [Di], block
    rope table [C//r + 1, n_rot/2, 2]) -> [T, C//r + 1] (last column: the spare block)."""

    ratio: int
    eps: float
    n_rot: int


@dataclass(frozen=True)
class IndexerTopK:
    """QSA selection: (block scores [T, NB+1], pos) -> [T, width] selected cell ids (-1: none);
    width = top_k + ratio - 1 (clamped to the context); the tail is always kept."""

    ratio: int
    width: int


@dataclass(frozen=True)
class CompressedScore:
    """Lightning-indexer scores over compressed rows: (q [T,Hi,Di], head weights [T,Hi], rows
    [NB,Di], pos) -> [T, NB], -inf at rows whose block of `ratio` positions is not complete."""

    ratio: int


@dataclass(frozen=True)
class CompressedAttention:
    """Attention of q [T,H,D] over one shared K = V head: the raw cells of a cache [C, D] within a
    sliding window, plus (ratio > 0) the complete rows [NB, D] of a compressed cache (all, or
    `selected`: those listed in a [T, k] int32 input), with per-head sink logits [H].
    Inputs (q, cache, sinks, pos[, rows[, sel]])."""

    scale: float
    window: int
    ratio: int = 0  # 0: raw cells only
    selected: bool = False


@dataclass(frozen=True)
class TokenTopK:
    """DSA selection: (token scores [T, P+T], pos) -> [T, width] cell ids, the `width` largest visible
    cells (j <= P+t) of each query by llama.cpp's CPU top-k (heap select); -1 where a slot holds no
    visible cell."""

    width: int


@dataclass(frozen=True)
class IndexerBlockScore:
    """MSA block scores: (q [T,G,Di] normed+roped, roped key cache [C,Di]) -> [T, G, C//block],
    the largest q . key of each block of `block` cells."""

    block: int


@dataclass(frozen=True)
class CompressorPool:
    """Compressed rows: (kv states [C, wide], score states [C, wide], ape [r, wide]) -> [C/r, d], per
    block and channel the kv of the block window weighted by the softmax of score + ape over it.
    `overlap`: wide = 2d and the window is 2r (block j-1's first d channels, then block j's last d);
    otherwise wide = d and the window is the block."""

    ratio: int
    overlap: bool


@dataclass(frozen=True)
class BlockTopK:
    """MSA selection: (block scores [T,G,NB], pos) -> [T, G, min(top_k, NB)] block ids (-1: none);
    the `local` blocks ending at the query's block first, then the best earlier ones."""

    block: int
    top_k: int
    local: int


@dataclass(frozen=True)
class BlockMask:
    """(selected blocks [T,G,K], pos) -> additive [G, T, P+T] mask: 0 at cells of selected blocks up
    to the query, -inf elsewhere."""

    block: int


@dataclass(frozen=True)
class PleHash:
    """PLE n-gram rows: (token history [C] int32, tokens [T], pos) -> [T, (n-1)*heads] int32."""

    ngram: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    eos: int


@dataclass(frozen=True)
class FusedElementwise:
    """A chain of elementwise ops evaluated in one kernel.

    `program` is a tuple of steps; each step is (op, attrs, operand indices), where operand
    index i < n_inputs names a graph input and i >= n_inputs names the result of step
    i - n_inputs. The last step is the output.
    """

    program: tuple[tuple[str, Any, tuple[int, ...]], ...]
    n_inputs: int


# ----------------------------------------------------------------------------------------------
# numpy references for elementwise functions (ggml semantics)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    # ggml switches to the identity above 20
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float16).astype(np.asarray(x).dtype)


GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456)


def gelu_tanh_f32(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_f32: 0.5x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))) in float32 as llama.cpp's CPU
    builds compile it: 1 + (0.044715 x) x fused (FMA), tanh rounded to float32 from float64. Over
    every F16 input it gives ggml_table_gelu_f16 bit for bit (tests/test_gemma3_270m.py), where
    numpy's float32 tanh misses 234 of its entries (h < -1.8: 1 + tanh cancels, the entry keeps
    tanh's last bits) and an unfused polynomial one more."""
    x = np.asarray(x, np.float32)
    poly = ((GELU_COEF_A * x).astype(np.float64) * x + 1.0).astype(np.float32)  # the product is exact
    inner = SQRT_2_OVER_PI * x * poly
    tanh = np.tanh(inner.astype(np.float64)).astype(np.float32)
    return (np.float32(0.5) * x * (np.float32(1.0) + tanh)).astype(np.float32)


def gelu_tanh_f16_ref(x: np.ndarray) -> np.ndarray:
    """GELU (tanh form) as llama.cpp's CPU backend computes it (ggml_vec_gelu_f32 with
    GGML_GELU_FP16): 0 for x <= -10, x for x >= 10, else the input rounded to F16 looked up in a
    table of F16(gelu_f32(h)) for every F16 value h."""
    xf = np.asarray(x)
    with np.errstate(over="ignore", invalid="ignore"):
        half = xf.astype(np.float16).astype(np.float32)
        table = gelu_tanh_f32(half).astype(np.float16).astype(xf.dtype)
    return np.where(xf <= -10.0, 0.0, np.where(xf >= 10.0, xf, table)).astype(xf.dtype)


UNARY_FNS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": lambda x: x * _sigmoid(x),
    "sigmoid": _sigmoid,
    "exp": np.exp,
    "neg": np.negative,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "relu": lambda x: np.maximum(x, 0),
    "softplus": _softplus,
    "square": np.square,
    "tanh": np.tanh,
    "recip": lambda x: 1.0 / x,
    "sign": np.sign,  # sign(0) = 0, as ggml_sgn
    "abs": np.abs,
    # to half precision and back (round to nearest even, inf beyond f16's range): llama.cpp's
    # flash attention reads K and V as F16
    "round_f16": lambda x: _round_f16(x),
    "gelu_tanh_f16": gelu_tanh_f16_ref,
}

BINARY_FNS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
    "min": np.minimum,
}

# scalar ops ("x fn c") take the binary functions plus a power by a constant
SCALAR_FNS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {**BINARY_FNS, "pow": np.power}

REDUCE_FNS: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "mean": np.mean, "max": np.max}


def _like(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=x.dtype)


def softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def rms_norm_ref(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """llama.cpp's steps: squares summed in float64, the mean rounded to x's precision, x times
    1 / sqrt(mean + eps), then times w."""
    ss = np.sum((x * x).astype(np.float64), axis=-1, keepdims=True)
    y = x * (x.dtype.type(1) / np.sqrt((ss / x.shape[-1]).astype(x.dtype) + x.dtype.type(eps)))
    return y if w is None else y * w


def rope_ref(x: np.ndarray, pos0: int, table: np.ndarray, attrs: Rope) -> np.ndarray:
    """x [T, H, D]; table [n_ctx, n_rot/2, 2] (cos, sin) for absolute positions."""
    t = x.shape[0]
    half = attrs.n_rot // 2
    cs = table[pos0 : pos0 + t].astype(x.dtype)
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    y = x.copy()
    if attrs.mode == "norm":
        a, b = x[..., 0 : attrs.n_rot : 2], x[..., 1 : attrs.n_rot : 2]
        y[..., 0 : attrs.n_rot : 2] = a * c - b * s
        y[..., 1 : attrs.n_rot : 2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half : attrs.n_rot]
        y[..., :half] = a * c - b * s
        y[..., half : attrs.n_rot] = a * s + b * c
    return y


def causal_mask_ref(t: int, p: int, dtype: Any) -> np.ndarray:
    """[T, P+T]: token i (absolute P+i) sees cells j <= P+i."""
    j = np.arange(p + t)[None, :]
    i = (p + np.arange(t))[:, None]
    return np.where(j <= i, 0.0, -np.inf).astype(dtype)


def window_mask_ref(t: int, p: int, window: int, dtype: Any) -> np.ndarray:
    """[T, P+T]: token i (absolute P+i) does not see cells j <= P+i - window (0: sees all)."""
    if not window:
        return np.zeros((t, p + t), dtype)
    j = np.arange(p + t)[None, :]
    i = (p + np.arange(t))[:, None]
    return np.where(i - j >= window, -np.inf, 0.0).astype(dtype)


def tanh_softcap_ref(x: np.ndarray, cap: float) -> np.ndarray:
    """c * tanh(x * (1/c)) with float32 constants, as ggml_scale, ggml_tanh, ggml_scale."""
    dt = x.dtype.type
    return (np.tanh(x * dt(np.float32(1.0) / np.float32(cap))) * dt(np.float32(cap))).astype(x.dtype)


def attention_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float,
                  mask: str = "causal", extra: np.ndarray | None = None, block: int = 0,
                  f16_pv_below: int = 0, window: int = 0, softcap: float = 0.0,
                  sinks: np.ndarray | None = None) -> np.ndarray:
    """q [T,H,D]; caches [C,Hkv,D] already holding this call's keys. Returns [T,H,D].
    `extra`: the additive [T, P+T] mask, or the [T, W] selected cell ids (see `Attention.mask`);
    `window`, `softcap`, `sinks` [H]: see `Attention`."""
    if q.shape[0] < f16_pv_below:
        return attention_f16_pv_ref(q, kc, vc, pos0, scale)
    t, h, d = q.shape
    hkv = kc.shape[1]
    s_len = pos0 + t
    k = np.repeat(kc[:s_len], h // hkv, axis=1)
    v = np.repeat(vc[:s_len], h // hkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k)
    if softcap:
        s = tanh_softcap_ref(s, softcap)
    s = s * q.dtype.type(scale) + causal_mask_ref(t, pos0, q.dtype)[None]
    if window:
        s = s + window_mask_ref(t, pos0, window, q.dtype)[None]
    if mask in ("additive", "indices", "blocks"):
        if extra is None:
            raise ValueError(f"attention mask {mask!r} needs `extra`")
        if mask == "blocks":
            extra = block_mask_ref(extra, pos0, block)
        elif mask == "indices":
            extra = index_mask_ref(extra, pos0)
        per_head = np.repeat(extra, h // hkv, axis=0) if extra.ndim == 3 else extra[None]
        s = s + per_head.astype(q.dtype)
    probs = softmax_ref(s, -1) if sinks is None else softmax_with_sinks_ref(s, sinks.astype(q.dtype))
    return np.einsum("hts,shd->thd", probs, v)


def softmax_with_sinks_ref(s: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of s [H, T, S] with one more logit sinks[h] per row of head h
    that takes part in the max and the denominator and gets no output column."""
    sink = sinks[:, None, None]
    m = np.maximum(s.max(axis=-1, keepdims=True), sink)
    e = np.exp(s - m)
    return e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - m))


def attention_f16_pv_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float) -> np.ndarray:
    """Causal attention as llama.cpp's CPU flash attention computes a row with F16 K/V
    (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): q rounded to f16 for the scores, then
    for each visible cell in order an online softmax (max M, sum S in float32) whose P.V
    accumulator is an f16 vector, rescaled (acc * e^(M_old - M)) and accumulated
    (acc + v e^(s - M)) with a rounding to f16 after each step; out = acc / S."""
    t, h, d = q.shape
    group = h // kc.shape[1]
    qh = _round_f16(q)
    out = np.zeros_like(q)
    for i in range(t):
        k = np.repeat(kc[: pos0 + i + 1], group, axis=1)  # [cells, H, D]
        v = np.repeat(vc[: pos0 + i + 1], group, axis=1)
        s = (np.einsum("shd,hd->sh", k, qh[i]).astype(np.float32) * np.float32(scale)).astype(q.dtype)
        m = np.full(h, -np.inf, dtype=q.dtype)
        total = np.zeros(h, dtype=q.dtype)
        acc = np.zeros((h, d), dtype=q.dtype)
        for c in range(s.shape[0]):
            new_max = s[c] > m
            ms = np.where(new_max, np.exp(np.where(new_max, m - s[c], 0.0)), 1.0)
            vs = np.where(new_max, 1.0, np.exp(np.minimum(s[c] - m, 0.0)))
            m = np.maximum(m, s[c])
            acc = _round_f16(_round_f16(acc * ms[:, None]) + v[c] * vs[:, None])
            total = total * ms + vs
        out[i] = acc * (1.0 / total)[:, None]
    return out


def topk_ref(x: np.ndarray, k: int, payload: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(values, ids) of the k largest of x per row; with a payload (same shape as x), the values
    are the payload's at those ids (MoE selection by biased scores, weights from unbiased ones)."""
    # stable descending order: ties keep the lower index first
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x if payload is None else payload, idx, -1), idx.astype(np.int32)


def fused_elementwise_ref(inputs: Sequence[np.ndarray], a: FusedElementwise) -> np.ndarray:
    vals: list[np.ndarray] = list(inputs)
    for op, attrs, operands in a.program:
        args = [vals[i] for i in operands]
        vals.append(ELEMENTWISE_REFS[op](args, attrs))
    return vals[-1]


ELEMENTWISE_REFS: dict[str, Callable[[list[np.ndarray], Any], np.ndarray]] = {
    "unary": lambda xs, a: _like(xs[0], UNARY_FNS[a.fn](xs[0])),
    "binary": lambda xs, a: BINARY_FNS[a.fn](xs[0], xs[1]),
    "scalar": lambda xs, a: _like(xs[0], SCALAR_FNS[a.fn](xs[0], xs[0].dtype.type(a.c))),
}

# ----------------------------------------------------------------------------------------------
# shape rules


def _broadcast(*shapes: Shape) -> Shape:
    nd = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(nd):
        dims = [s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0]
        concrete = {d for d in dims if d != 1}
        if len(concrete) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(concrete.pop() if concrete else 1)
    return tuple(out)


def _norm_axis(axis: int, nd: int) -> int:
    return axis if axis >= 0 else nd + axis


ShapeDtype = tuple[Shape, str]


def _same(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [ins[0]]


def _binary_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [(_broadcast(ins[0][0], ins[1][0]), ins[0][1])]


def _reduce_shape(ins: Sequence[ShapeDtype], a: Reduce) -> list[ShapeDtype]:
    shape, dt = ins[0]
    ax = _norm_axis(a.axis, len(shape))
    kept = tuple(1 if i == ax else d for i, d in enumerate(shape))
    out = kept if a.keepdims else shape[:ax] + shape[ax + 1 :]
    return [(out, dt)]


def _transpose_shape(ins: Sequence[ShapeDtype], a: Transpose) -> list[ShapeDtype]:
    return [(tuple(ins[0][0][p] for p in a.perm), ins[0][1])]


def _slice_shape(ins: Sequence[ShapeDtype], a: Slice) -> list[ShapeDtype]:
    shape = list(ins[0][0])
    shape[_norm_axis(a.axis, len(shape))] = a.stop - a.start
    return [(tuple(shape), ins[0][1])]


def _concat_shape(ins: Sequence[ShapeDtype], a: Concat) -> list[ShapeDtype]:
    shape = list(ins[0][0])
    ax = _norm_axis(a.axis, len(shape))
    dims = [s[ax] for s, _ in ins]
    known = [d for d in dims if isinstance(d, int)]
    shape[ax] = sum(known) if len(known) == len(dims) else "+".join(f"({d})" for d in dims)
    return [(tuple(shape), ins[0][1])]


def _matmul_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xs, _), (ws, _) = ins[0], ins[1]
    if xs[-1] != ws[-1]:
        raise ValueError(f"matmul: x {xs} and weight {ws} disagree on K")
    if len(ins) == 3 and ins[2][0] != _block_sums_shape(xs):
        raise ValueError(f"matmul: block sums {ins[2][0]} do not match x {xs}")
    return [(xs[:-1] + (ws[0],), "float32")]


def _block_sums_shape(xs: Shape) -> Shape:
    k = xs[-1]
    return (*xs[:-1], k // ACT_BLOCK if isinstance(k, int) else f"({k})/{ACT_BLOCK}")


def _quantize_act_shape(ins: Sequence[ShapeDtype], a: QuantizeAct) -> list[ShapeDtype]:
    return [ins[0], (_block_sums_shape(ins[0][0]), "float32")] if a.scheme == "q8_1" else [ins[0]]


def _quantize_act_ref(i: Sequence[np.ndarray], a: QuantizeAct, ctx: Any) -> list[np.ndarray]:
    out = quantize_act_ref(i[0], a.scheme)
    return [out, q8_1_sums_ref(i[0]).astype(out.dtype)] if a.scheme == "q8_1" else [out]


def matmul_ref(i: Sequence[np.ndarray], a: Any, ctx: Any) -> np.ndarray:
    """x @ W.T; with q8_1 block sums s (inputs x, W, s, and the interpreter appends W's block
    minimums m): the m term of each block uses s_b instead of the block sum of x."""
    x, w = i[0], i[1]
    y = x @ w.T.astype(x.dtype)
    if len(i) == 2:
        return y
    s, mins = i[2], i[3].astype(x.dtype)
    block_sums = x.reshape(*x.shape[:-1], -1, ACT_BLOCK).sum(axis=-1)
    return y + (s - block_sums) @ mins.T


def _matmul_mins(n_inputs: int, a: Any) -> tuple[int, ...]:
    """matmul(x, W, s) reads the block minimums of W (input 1)."""
    return (1,) if n_inputs == 3 else ()


def _rounded_matmul(x: np.ndarray, w: np.ndarray, mins: Sequence[np.ndarray], scheme: str) -> np.ndarray:
    """matmul_ref of quantize_act's outputs: exactly what the spelled pair computes."""
    rounded = _quantize_act_ref([x], QuantizeAct(scheme), None)  # [x'] or [x', block sums]
    return matmul_ref([rounded[0], w, *rounded[1:], *mins], None, None)


def _int8_matmul_shape(ins: Sequence[ShapeDtype], a: Int8Matmul) -> list[ShapeDtype]:
    return _matmul_shape(ins, a)


def _int8_matmul_mins(n_inputs: int, a: Int8Matmul) -> tuple[int, ...]:
    return (1,) if a.scheme == "q8_1" else ()


def _int8_matmul_ref(i: Sequence[np.ndarray], a: Int8Matmul, ctx: Any) -> list[np.ndarray]:
    return [_rounded_matmul(i[0], i[1], i[2:], a.scheme)]


def _gemv_group_input(i: Sequence[np.ndarray], a: GemvGroup) -> np.ndarray:
    if a.prologue == "rms_norm":
        return rms_norm_ref(i[0], i[1], a.eps)
    if a.prologue == "swiglu":
        return i[0] * _sigmoid(i[0]) * i[1]
    return i[0]


def _gemv_group_shape(ins: Sequence[ShapeDtype], a: GemvGroup) -> list[ShapeDtype]:
    if len(ins) != a.n_prologue + a.n_weights + a.residual or a.n_weights < 1 or (a.residual and a.n_weights != 1):
        raise ValueError(f"int8_gemv_group {a}: {len(ins)} inputs")
    x = ins[0]
    if a.prologue == "swiglu" and tuple(ins[1][0]) != tuple(x[0]):
        raise ValueError(f"int8_gemv_group: gate {x[0]} and up {ins[1][0]} differ")
    weights = ins[a.n_prologue:a.n_prologue + a.n_weights]
    outs = [_matmul_shape([x, w], a)[0] for w in weights]
    if a.residual and tuple(ins[-1][0]) != tuple(outs[0][0]):
        raise ValueError(f"int8_gemv_group: residual {ins[-1][0]} is not the output's shape {outs[0][0]}")
    return outs


def _gemv_group_mins(n_inputs: int, a: GemvGroup) -> tuple[int, ...]:
    return tuple(range(a.n_prologue, a.n_prologue + a.n_weights)) if a.scheme == "q8_1" else ()


def _gemv_group_ref(i: Sequence[np.ndarray], a: GemvGroup, ctx: Any) -> list[np.ndarray]:
    x = _gemv_group_input(i, a)
    weights = i[a.n_prologue:a.n_prologue + a.n_weights]
    tail = i[a.n_prologue + a.n_weights:]
    residual, mins = (tail[0], tail[1:]) if a.residual else (None, tail)
    outs = [_rounded_matmul(x, w, mins[j:j + 1], a.scheme) for j, w in enumerate(weights)]
    return [outs[0] + residual] if residual is not None else outs


def _bmm_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xa, _), (xb, _) = ins
    return [((xa[0], xa[1], xb[1]), "float32")]


def _bmm_nn_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xa, _), (xb, _) = ins
    return [((xa[0], xa[1], xb[2]), "float32")]


def _gather_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (table, dt), (ids, _) = ins
    return [(ids + table[1:], "float32" if dt not in ("int32", "int64") else dt)]


def _matmul_id_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xs, _), (ws, _), (ids, _) = ins
    return [((ids[0], ids[1], ws[1]), "float32")]


def _topk_shape(ins: Sequence[ShapeDtype], a: TopK) -> list[ShapeDtype]:
    shape = ins[0][0][:-1] + (a.k,)
    if len(ins) > 1 and tuple(ins[1][0]) != tuple(ins[0][0]):
        raise ValueError(f"topk: payload {ins[1][0]} does not have the scores' shape {ins[0][0]}")
    return [(shape, ins[-1][1]), (shape, "int32")]


def _take_along_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    """x [..., X], ids [..., k] int32 -> [..., k]: x's values at the ids along the last axis."""
    (xs, dt), (ids, it) = ins
    lead_ok = all(p == q for p, q in zip(xs[:-1], ids[:-1], strict=False) if isinstance(p, int) and isinstance(q, int))
    if len(xs) != len(ids) or it != "int32" or not lead_ok:
        raise ValueError(f"take_along: ids {it}{list(ids)} do not index the last axis of {list(xs)}")
    return [(ids, dt)]


def _route_shape(ins: Sequence[ShapeDtype], a: MoeRoute) -> list[ShapeDtype]:
    check_routing(a, ins[0][0][-1], *(s for s, _ in ins[1:]))
    shape = ins[0][0][:-1] + (a.k,)
    return [(shape, "float32"), (shape, "int32")]


def _topk_softmax_shape(ins: Sequence[ShapeDtype], a: MoeTopkSoftmax) -> list[ShapeDtype]:
    logits, n_exp = ins[0][0], ins[0][0][-1]
    if len(ins) != 1 + a.biased or (a.biased and tuple(ins[1][0]) != (n_exp,)):
        raise ValueError(f"moe_topk_softmax: biased={a.biased} takes logits [T, X]{' and a bias [X]' * a.biased}, "
                         f"got {[list(s) for s, _ in ins]}")
    if isinstance(n_exp, int) and not 0 < a.k <= n_exp:
        raise ValueError(f"moe_topk_softmax: k={a.k} is not in 1..{n_exp} experts")
    shape = logits[:-1] + (a.k,)
    return [(shape, "float32"), (shape, "int32")]


def _cache_read_shape(ins: Sequence[ShapeDtype], a: Tokens) -> list[ShapeDtype]:
    return [(("P+T",) + ins[0][0][1:], ins[0][1])]


def _positions_shape(ins: Sequence[ShapeDtype], a: Tokens) -> list[ShapeDtype]:
    return [((a.n,), "int32")]


def _mask_shape(ins: Sequence[ShapeDtype], a: Tokens) -> list[ShapeDtype]:
    return [((a.n, "P+T"), "float32")]


def _last_token_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [((1,) + ins[0][0][1:], ins[0][1])]


def _reshape_shape(ins: Sequence[ShapeDtype], a: Reshape) -> list[ShapeDtype]:
    return [(a.shape, ins[0][1])]


def _dequant_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [(ins[0][0], "float32")]


def _elementwise_shape(ins: Sequence[ShapeDtype], a: FusedElementwise) -> list[ShapeDtype]:
    return [(_broadcast(*[s for s, _ in ins]), ins[0][1])]


def _moe_ffn_shape(ins: Sequence[ShapeDtype], a: MoeFFN) -> list[ShapeDtype]:
    n = moe_inputs([s for s, _ in ins], a)
    check_routing(a, n["router"][0], *((n["hash_table"], n["tokens"]) if a.hash_routed else
                                       (n["bias"],) if a.selection_bias else ()))
    if a.merged_gate_up and (not a.has_gate or {"gate", "up"} & set(a.expert_scales)):
        raise ValueError("moe_ffn: a merged gate_up tensor has a gate and no gate/up scales")
    if a.merged_gate_up and n["gate_up"][1] != 2 * n["down"][2]:
        raise ValueError(f"moe_ffn: merged gate_up {n['gate_up']} is not twice the down's hidden {n['down']}")
    return [ins[0]]


def _rms_norm_gated_shape(ins: Sequence[ShapeDtype], a: RMSNormGated) -> list[ShapeDtype]:
    (xs, dt), (ws, _), (zs, _) = ins
    if tuple(ws) != (xs[-1],) or len(zs) != len(xs) or any(p != q for p, q in zip(xs, zs, strict=True)):
        raise ValueError(f"rms_norm_gated: x {xs}, weight {ws} and gate {zs} disagree")
    return [(xs, dt)]


def _ssm_conv_shape(ins: Sequence[ShapeDtype], a: SsmConv) -> list[ShapeDtype]:
    """(state [C, (K-1)*dilation], x [T, C], w [C, K]) -> (new state, y [T, C])."""
    (ss, sdt), (xs, _), (ws, _) = ins
    n_ch, k = ws
    if len(xs) != 2 or xs[1] != n_ch or tuple(ss) != (n_ch, (int(k) - 1) * a.dilation):
        raise ValueError(f"ssm_conv: state {ss}, x {xs} and kernel {ws} disagree (dilation {a.dilation})")
    return [(ss, sdt), ((xs[0], n_ch), "float32")]


def _gated_delta_net_shape(ins: Sequence[ShapeDtype], a: GatedDeltaNet) -> list[ShapeDtype]:
    """(state [Hv,Dv,Dk], q [T,Hk,Dk], k [T,Hk,Dk], v [T,Hv,Dv], g [T,Hv] (key_decay: [T,Hv,Dk]),
    beta [T,Hv]) -> (state, o)."""
    (ss, sdt), (qs, _), (ks, _), (vs, _), (gs, _), (bs, _) = ins
    hv, dv, dk = ss
    t, hk = qs[0], qs[1]
    ok = (
        tuple(qs) == (t, hk, dk) and tuple(ks) == tuple(qs) and tuple(vs) == (t, hv, dv)
        and tuple(gs) == ((t, hv, dk) if a.key_decay else (t, hv)) and tuple(bs) == (t, hv)
        and isinstance(hk, int) and hv % hk == 0
        and a.head_map in ("tiled", "interleaved")
    )
    if not ok:
        raise ValueError(f"gated_delta_net: state {ss}, q {qs}, k {ks}, v {vs}, g {gs}, beta {bs} disagree")
    return [(ss, sdt), (vs, "float32")]


def _attention_shape(ins: Sequence[ShapeDtype], a: Attention) -> list[ShapeDtype]:
    n_in = 4 if a.mask == "causal" and not a.sinks else 5
    if len(ins) != n_in or a.mask not in ("causal", "additive", "indices", "blocks"):
        raise ValueError(f"attention with mask {a.mask!r} takes {n_in} inputs, got {len(ins)}")
    if a.sinks and (a.mask != "causal" or a.f16_pv_below or tuple(ins[4][0]) != (ins[0][0][1],)):
        raise ValueError(f"attention: sinks {ins[4]} must be [H] and need the causal float32 form")
    if a.mask == "indices" and (ins[4][1] != "int32" or ins[4][0][0] != ins[0][0][0]):
        raise ValueError(f"attention: selected cells {ins[4]} must be int32 [T, W]")
    n_kv = ins[1][0][1]
    if a.mask == "blocks" and (ins[4][1] != "int32" or tuple(ins[4][0][:2]) != (ins[0][0][0], n_kv) or a.block <= 0):
        raise ValueError(f"attention: selected blocks {ins[4]} must be int32 [T, Hkv, K] with a block size > 0")
    if a.f16_pv_below and a.mask != "causal":
        raise ValueError(f"attention: f16 P.V accumulation is defined for the causal mask, not {a.mask!r}")
    if (a.window or a.softcap) and (a.mask != "causal" or a.f16_pv_below):
        raise ValueError("attention: a window or softcap is defined for the causal float32 form only")
    if a.window < 0 or a.softcap < 0:
        raise ValueError(f"attention: window {a.window} and softcap {a.softcap} must be >= 0")
    return [ins[0]]


def _hc_pre_sinkhorn_shape(ins: Sequence[ShapeDtype], a: HcPre) -> list[ShapeDtype]:
    (rs, dt), (fs, _), (ss, _), (bs, _) = ins
    t, hc, e = rs
    n_mix = (2 + a.n_hc) * a.n_hc if a.post else a.n_hc
    ok = hc == a.n_hc and tuple(fs) == (n_mix, hc * e) and tuple(ss) == ((3,) if a.post else (1,))
    if not ok or tuple(bs) != (n_mix,) or (a.post and a.n_iter < 1):
        raise ValueError(f"hc_pre {a}: streams {rs}, weights {[s for s, _ in ins[1:]]} disagree")
    if not a.post:
        return [((t, e), dt)]
    return [((t, e), dt), ((t, hc), dt), ((t, hc, hc), dt)]


def _hc_pre_shape(ins: Sequence[ShapeDtype], a: HcPre) -> list[ShapeDtype]:
    if a.rule == "sinkhorn":
        return _hc_pre_sinkhorn_shape(ins, a)
    (rs, dt), (ns, _), (ds, _), (us, _), *rest = ins
    t, hc, e = rs
    ok = hc == a.n_hc and tuple(ns) == (hc, e) and ds[1] == hc * e and tuple(us) == (hc * e, ds[0])
    ok = ok and len(rest) == (1 if a.post else 0) and a.rule == "sigmoid_mean"
    if ok and a.post:
        ok = tuple(rest[0][0]) == (a.n_hc, a.n_hc * e)  # hc == a.n_hc here
    if not ok:
        raise ValueError(f"hc_pre {a}: streams {rs}, weights {[s for s, _ in ins[1:]]} disagree")
    outs: list[ShapeDtype] = [((t, e), dt)]
    if a.post:
        outs.append(((t, hc), dt))
    return outs


def _res_mix_shape(ins: Sequence[ShapeDtype], a: ResMix) -> list[ShapeDtype]:
    (ss, _), (cs, dt), (ws, _) = ins
    if len(ss) != 3 or len(cs) != 2 or cs[0] != ss[0] or cs[1] != ss[2] or tuple(ws) != (ss[2],):
        raise ValueError(f"res_mix: bank {ss}, stream {cs} and score weight {ws} disagree")
    return [(cs, dt)]


def _hc_post_shape(ins: Sequence[ShapeDtype], a: HcPost) -> list[ShapeDtype]:
    (rs, dt), (ys, _), (ps, _), *rest = ins
    t, hc, e = rs
    ok = tuple(ys) == (t, e) and tuple(ps) == (t, hc) and len(rest) == int(a.comb)
    if not ok or (a.comb and tuple(rest[0][0]) != (t, hc, hc)):
        raise ValueError(f"hc_post: streams {rs}, y {ys}, post {ps} disagree")
    return [(rs, dt)]


def _indexer_score_shape(ins: Sequence[ShapeDtype], a: IndexerScore) -> list[ShapeDtype]:
    (qs, dt), (cs, _), (ns, _), (tabs, _) = ins
    n_cells, di = cs
    nb1 = int(n_cells) // a.ratio + 1
    if len(qs) != 3 or qs[2] != di or tuple(ns) != (di,) or tuple(tabs) != (nb1, a.n_rot // 2, 2):
        raise ValueError(f"indexer_score: q {qs}, cache {cs}, norm {ns}, table {tabs} disagree")
    return [((qs[0], nb1), "float32")]


def _indexer_topk_shape(ins: Sequence[ShapeDtype], a: IndexerTopK) -> list[ShapeDtype]:
    (ss, _), _pos = ins
    return [((ss[0], a.width), "int32")]


def _index_mask_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (ss, dt), _pos = ins
    if dt != "int32" or len(ss) != 2:
        raise ValueError(f"index_mask takes [T, W] int32 cell ids, got {dt}{list(ss)}")
    return [((ss[0], "P+T"), "float32")]


def _compressed_score_shape(ins: Sequence[ShapeDtype], a: CompressedScore) -> list[ShapeDtype]:
    (qs, dt), (ws, _), (rs, _), _pos = ins
    if len(qs) != 3 or tuple(ws) != (qs[0], qs[1]) or len(rs) != 2 or rs[1] != qs[2]:
        raise ValueError(f"compressed_score: q {qs}, weights {ws}, rows {rs} disagree")
    return [((qs[0], rs[0]), dt)]


def _compressed_attention_shape(ins: Sequence[ShapeDtype], a: CompressedAttention) -> list[ShapeDtype]:
    n_in = 4 + (a.ratio > 0) + a.selected
    if len(ins) != n_in or (a.selected and a.ratio <= 0):
        raise ValueError(f"compressed_attention {a} takes {n_in} inputs, got {len(ins)}")
    (qs, dt), (cs, _), (ss, _) = ins[:3]
    ok = len(qs) == 3 and len(cs) == 2 and cs[1] == qs[2] and tuple(ss) == (qs[1],)
    if a.ratio > 0:
        ok = ok and len(ins[4][0]) == 2 and ins[4][0][1] == qs[2]
    if a.selected:
        ok = ok and ins[5][1] == "int32" and len(ins[5][0]) == 2 and ins[5][0][0] == qs[0]
    if not ok:
        raise ValueError(f"compressed_attention: inputs {[s for s, _ in ins]} disagree")
    return [(qs, dt)]

def _token_score_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (qs, _), (cs, _), (ws, _), _pos = ins
    if len(qs) != 3 or len(cs) != 2 or qs[2] != cs[1] or tuple(ws) != tuple(qs[:2]):
        raise ValueError(f"token_score: q {qs}, key cache {cs}, head weights {ws} disagree")
    return [((qs[0], "P+T"), "float32")]


def _token_topk_shape(ins: Sequence[ShapeDtype], a: TokenTopK) -> list[ShapeDtype]:
    (ss, _), _pos = ins
    if len(ss) != 2 or a.width <= 0:
        raise ValueError(f"token_topk: scores {ss} must be [T, P+T] and width positive ({a.width})")
    return [((ss[0], a.width), "int32")]


def _head_matmul_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xs, _), (ws, _) = ins
    if len(xs) != 3 or len(ws) != 3 or xs[1] != ws[0] or xs[2] != ws[2]:
        raise ValueError(f"head_matmul: x {xs} [T, H, K] and weight {ws} [H, N, K] disagree")
    return [((xs[0], xs[1], ws[1]), "float32")]


def _block_score_shape(ins: Sequence[ShapeDtype], a: IndexerBlockScore) -> list[ShapeDtype]:
    (qs, _), (cs, _) = ins
    if len(qs) != 3 or len(cs) != 2 or qs[2] != cs[1] or a.block <= 0:
        raise ValueError(f"indexer_block_score: q {qs} and key cache {cs} disagree (block {a.block})")
    return [((qs[0], qs[1], int(cs[0]) // a.block), "float32")]


def _compressor_pool_shape(ins: Sequence[ShapeDtype], a: CompressorPool) -> list[ShapeDtype]:
    (ks, _), (ss, _), (ap, _) = ins
    wide = ks[1] if len(ks) == 2 else 0
    if (len(ks) != 2 or tuple(ss) != tuple(ks) or tuple(ap) != (a.ratio, wide) or a.ratio <= 0
            or int(ks[0]) % a.ratio or (a.overlap and int(wide) % 2)):
        raise ValueError(f"compressor_pool {a}: kv {ks}, score {ss} [C, wide] (C whole blocks) and ape {ap} "
                         f"[r, wide] disagree")
    return [((int(ks[0]) // a.ratio, int(wide) // 2 if a.overlap else wide), "float32")]


def _block_topk_shape(ins: Sequence[ShapeDtype], a: BlockTopK) -> list[ShapeDtype]:
    (ss, _), _pos = ins
    if len(ss) != 3 or min(a.block, a.top_k, a.local) <= 0:
        raise ValueError(f"block_topk: scores {ss} must be [T, G, NB]; block, top_k and local must be positive")
    return [((ss[0], ss[1], min(a.top_k, int(ss[2]))), "int32")]


def _block_mask_shape(ins: Sequence[ShapeDtype], a: BlockMask) -> list[ShapeDtype]:
    (ss, dt), _pos = ins
    if dt != "int32" or len(ss) != 3:
        raise ValueError(f"block_mask takes [T, G, K] int32 block ids, got {dt}{list(ss)}")
    return [((ss[1], ss[0], "P+T"), "float32")]


def _ple_hash_shape(ins: Sequence[ShapeDtype], a: PleHash) -> list[ShapeDtype]:
    (hs, hdt), (ts, _), _pos = ins
    n_heads = (a.ngram - 1) * a.heads_per_ngram
    if hdt != "int32" or len(hs) != 1 or len(a.offsets) < n_heads or len(a.sizes) < n_heads:
        raise ValueError(f"ple_hash: history {hdt}{list(hs)} or head tables do not fit {n_heads} heads")
    return [((ts[0], n_heads), "int32")]


# ----------------------------------------------------------------------------------------------
# references keyed by op


def _ref_reduce(x: np.ndarray, a: Reduce) -> np.ndarray:
    return _like(x, REDUCE_FNS[a.fn](x, axis=a.axis, keepdims=a.keepdims))


def _ref_reshape(x: np.ndarray, a: Reshape, ctx: dict[str, int]) -> np.ndarray:
    return x.reshape(eval_shape(a.shape, ctx))


def _ref_cache_write(cache: np.ndarray, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    out = cache.copy()
    p = int(pos)
    out[p : p + x.shape[0]] = x
    return out


def _ref_cache_read(cache: np.ndarray, pos: np.ndarray, ctx: dict[str, int]) -> np.ndarray:
    return cache[: int(pos) + ctx["T"]]


def _ref_gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return table[ids.astype(np.int64)]


def _lightning_attention_shape(ins: Sequence[ShapeDtype], a: LightningAttention) -> list[ShapeDtype]:
    (ss, sdt), (qs, _), (ks, _), (vs, _) = ins
    h, dk, dv = ss
    t = qs[0]
    ok = (tuple(qs) == (t, h, dk) and tuple(ks) == tuple(qs) and tuple(vs) == (t, h, dv)
          and len(a.slopes) == h)
    if not ok:
        raise ValueError(f"lightning_attention: state {ss}, q {qs}, k {ks}, v {vs}, {len(a.slopes)} slopes disagree")
    return [(ss, sdt), (vs, "float32")]


def _ref_gated_delta_net(ins: Sequence[np.ndarray], a: GatedDeltaNet) -> list[np.ndarray]:
    state, q, k, v, g, beta = ins
    return list(gated_delta_net_ref(state, q, k, v, g, beta, a.head_map, a.scale))


@dataclass(frozen=True)
class OpDef:
    name: str
    attrs: type
    infer: Callable[[Sequence[ShapeDtype], Any], list[ShapeDtype]]
    ref: Callable[..., Any]  # (inputs, attrs, ctx) -> list of outputs
    fused: bool = False
    effects: bool = False
    # input positions (given the input count) whose weight's block minimums the reference reads;
    # the interpreter appends them to the inputs (ir/interp.py)
    block_mins: Callable[[int, Any], tuple[int, ...]] = lambda n_inputs, attrs: ()


def _one(f: Callable[..., np.ndarray]) -> Callable[..., list[np.ndarray]]:
    return lambda ins, a, ctx: [f(ins, a, ctx)]


OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        # primitives
        OpDef("unary", Unary, _same, _one(lambda i, a, c: _like(i[0], UNARY_FNS[a.fn](i[0])))),
        OpDef("binary", Binary, _binary_shape, _one(lambda i, a, c: BINARY_FNS[a.fn](i[0], i[1]))),
        OpDef("scalar", Scalar, _same, _one(lambda i, a, c: ELEMENTWISE_REFS["scalar"](list(i), a))),
        OpDef("reduce", Reduce, _reduce_shape, _one(lambda i, a, c: _ref_reduce(i[0], a))),
        OpDef("reshape", Reshape, _reshape_shape, _one(lambda i, a, c: _ref_reshape(i[0], a, c))),
        OpDef("transpose", Transpose, _transpose_shape, _one(lambda i, a, c: np.transpose(i[0], a.perm))),
        OpDef("slice", Slice, _slice_shape,
              _one(lambda i, a, c: np.take(i[0], np.arange(a.start, a.stop), axis=a.axis))),
        OpDef("concat", Concat, _concat_shape, _one(lambda i, a, c: np.concatenate(i, axis=a.axis))),
        OpDef("dequantize", NoAttrs, _dequant_shape, _one(lambda i, a, c: i[0])),
        OpDef("gather", NoAttrs, _gather_shape, _one(lambda i, a, c: _ref_gather(i[0], i[1]))),
        OpDef("quantize_act", QuantizeAct, _quantize_act_shape, _quantize_act_ref),
        OpDef("matmul", NoAttrs, _matmul_shape, _one(matmul_ref), block_mins=_matmul_mins),
        OpDef("bmm_nt", NoAttrs, _bmm_shape, _one(lambda i, a, c: i[0] @ np.swapaxes(i[1], 1, 2))),
        OpDef("bmm_nn", NoAttrs, _bmm_nn_shape, _one(lambda i, a, c: i[0] @ i[1])),
        OpDef("matmul_id", NoAttrs, _matmul_id_shape, _one(lambda i, a, c: matmul_id_ref(i[0], i[1], i[2]))),
        OpDef("take_along", NoAttrs, _take_along_shape,
              _one(lambda i, a, c: np.take_along_axis(i[0], i[1].astype(np.int64), -1))),
        OpDef("topk", TopK, _topk_shape, lambda i, a, c: list(topk_ref(i[0], a.k, i[1] if len(i) > 1 else None))),
        OpDef("positions", Tokens, _positions_shape,
              _one(lambda i, a, c: (int(i[0]) + np.arange(c["T"])).astype(np.int32))),
        OpDef("causal_mask", Tokens, _mask_shape,
              _one(lambda i, a, c: causal_mask_ref(c["T"], int(i[0]), np.float32))),
        OpDef("window_mask", WindowMask, _mask_shape,
              _one(lambda i, a, c: window_mask_ref(c["T"], int(i[0]), a.window, np.float32))),
        OpDef("last_token", NoAttrs, _last_token_shape, _one(lambda i, a, c: i[0][-1:])),
        OpDef("cache_write", NoAttrs, _same, _one(lambda i, a, c: _ref_cache_write(i[0], i[1], i[2])),
              effects=True),
        OpDef("cache_read", Tokens, _cache_read_shape, _one(lambda i, a, c: _ref_cache_read(i[0], i[1], c))),
        # recurrent state (gated delta-net family): inputs[0] is the state, outputs[0] its new version
        OpDef("ssm_conv", SsmConv, _ssm_conv_shape,
              lambda i, a, c: list(ssm_conv_ref(i[0], i[1], i[2], a.dilation)), effects=True),
        OpDef("gated_delta_net", GatedDeltaNet, _gated_delta_net_shape,
              lambda i, a, c: _ref_gated_delta_net(i, a), effects=True),
        OpDef("lightning_attention", LightningAttention, _lightning_attention_shape,
              lambda i, a, c: list(lightning_attention_ref(i[0], i[1], i[2], i[3], a.slopes, a.layer_scale)),
              effects=True),
        # qwen4exp: the hyper-connection mix, the QSA indexer, the PLE n-gram hash
        OpDef("indexer_topk", IndexerTopK, _indexer_topk_shape,
              _one(lambda i, a, c: indexer_topk_ref(i[0], int(i[1]), a.ratio, a.width))),
        OpDef("index_mask", NoAttrs, _index_mask_shape, _one(lambda i, a, c: index_mask_ref(i[0], int(i[1])))),
        # compressed rows (deepseek4's CSA/HCA): the lightning indexer's scores, attention with sinks
        OpDef("compressed_score", CompressedScore, _compressed_score_shape,
              _one(lambda i, a, c: compressed_score_ref(i[0], i[1], i[2], int(i[3]), a.ratio))),
        OpDef("compressed_attention", CompressedAttention, _compressed_attention_shape,
              _one(lambda i, a, c: compressed_attention_ref(
                  i[0], i[1], i[2], int(i[3]), a.scale, a.window, a.ratio, i[4] if a.ratio > 0 else None,
                  i[5] if a.selected else None))),
        # DSA (token-level indexer): the lightning indexer's scores and its top-k
        OpDef("token_topk", TokenTopK, _token_topk_shape, _one(lambda i, a, c: token_topk_ref(i[0], int(i[1]),
                                                                                              a.width))),
        OpDef("token_score", NoAttrs, _token_score_shape,
              _one(lambda i, a, c: token_score_ref(i[0], i[1], i[2], int(i[3]))), fused=True),
        # MLA: the absorbed per-head projections (attn_k_b into q, attn_v_b on the latent output)
        OpDef("head_matmul", NoAttrs, _head_matmul_shape, _one(lambda i, a, c: head_matmul_ref(i[0], i[1]))),
        # minimax-m3: MSA block selection
        OpDef("block_topk", BlockTopK, _block_topk_shape,
              _one(lambda i, a, c: block_topk_ref(i[0], int(i[1]), a.block, a.top_k, a.local))),
        OpDef("block_mask", BlockMask, _block_mask_shape,
              _one(lambda i, a, c: block_mask_ref(i[0], int(i[1]), a.block))),
        OpDef("ple_hash", PleHash, _ple_hash_shape,
              _one(lambda i, a, c: ple_hash_ref(i[0], i[1], int(i[2]), a.ngram, a.heads_per_ngram, a.multipliers,
                                                a.offsets, a.sizes, a.eos))),
        OpDef("hc_pre", HcPre, _hc_pre_shape, lambda i, a, c: hc_pre_ref(i, a.n_hc, a.eps, a.rule, a.post,
                                                                          a.hc_eps, a.n_iter),
              fused=True),
        OpDef("hc_post", HcPost, _hc_post_shape,
              _one(lambda i, a, c: hc_post_ref(i[0], i[1], i[2], i[3] if a.comb else None)), fused=True),
        OpDef("res_mix", ResMix, _res_mix_shape, _one(lambda i, a, c: res_mix_ref(i[0], i[1], i[2], a.eps)),
              fused=True),
        OpDef("indexer_score", IndexerScore, _indexer_score_shape,
              _one(lambda i, a, c: indexer_score_ref(i[0], i[1], i[2], i[3], a.ratio, a.eps, a.n_rot)), fused=True),
        OpDef("indexer_block_score", IndexerBlockScore, _block_score_shape,
              _one(lambda i, a, c: block_score_ref(i[0], i[1], a.block)), fused=True),
        OpDef("compressor_pool", CompressorPool, _compressor_pool_shape,
              _one(lambda i, a, c: compressor_pool_ref(i[0], i[1], i[2], a.ratio, a.overlap)), fused=True),
        # fused
        OpDef("softmax", Softmax, _same, _one(lambda i, a, c: softmax_ref(i[0], a.axis)), fused=True),
        # rms_norm: inputs (x,) or (x, weight)
        OpDef("rms_norm", RMSNorm, _same,
              _one(lambda i, a, c: rms_norm_ref(i[0], i[1] if len(i) > 1 else None, a.eps)), fused=True),
        OpDef("rope", Rope, _same, _one(lambda i, a, c: rope_ref(i[0], int(i[1]), i[2], a)), fused=True),
        OpDef("attention", Attention, _attention_shape,
              _one(lambda i, a, c: attention_ref(i[0], i[1], i[2], int(i[3]), a.scale, a.mask,
                                                 i[4] if len(i) > 4 and not a.sinks else None, a.block,
                                                 a.f16_pv_below, a.window, a.softcap, i[4] if a.sinks else None)),
              fused=True),
        OpDef("swiglu", NoAttrs, _same, _one(lambda i, a, c: i[0] * _sigmoid(i[0]) * i[1]), fused=True),
        OpDef("moe_route", MoeRoute, _route_shape,
              lambda i, a, c: list(moe_route_ref(i[0], a, *i[1:])), fused=True),
        OpDef("moe_topk_softmax", MoeTopkSoftmax, _topk_softmax_shape,
              lambda i, a, c: list(topk_softmax_ref(i[0], a.k, i[1] if a.biased else None)), fused=True),
        OpDef("moe_ffn", MoeFFN, _moe_ffn_shape, _one(lambda i, a, c: moe_ffn_node_ref(i, a)), fused=True),
        OpDef("fused_elementwise", FusedElementwise, _elementwise_shape,
              _one(lambda i, a, c: fused_elementwise_ref(i, a)), fused=True),
        OpDef("l2_norm", L2Norm, _same, _one(lambda i, a, c: l2_norm_ref(i[0], a.eps)), fused=True),
        OpDef("int8_matmul", Int8Matmul, _int8_matmul_shape, _int8_matmul_ref, fused=True,
              block_mins=_int8_matmul_mins),
        OpDef("int8_gemv_group", GemvGroup, _gemv_group_shape, _gemv_group_ref, fused=True,
              block_mins=_gemv_group_mins),
        # rms_norm_gated: inputs (x, weight, gate)
        OpDef("rms_norm_gated", RMSNormGated, _rms_norm_gated_shape,
              _one(lambda i, a, c: rms_norm_gated_ref(i[0], i[1], i[2], a.eps, a.act)), fused=True),
    ]
}

ELEMENTWISE_OPS = frozenset({"unary", "binary", "scalar"})
