"""numpy references of the recurrent (linear-attention) ops: the executable spec of the gated
delta-net family (llama.cpp `delta-net-base.cpp`, `ggml_ssm_conv`, `ggml_gated_delta_net`).

The op records in `ops.py` call these. Shapes (numpy order, one sequence):

* conv state `[C, (K-1)*dilation]`: the last inputs of the previous call, oldest first;
* recurrent state `[Hv, Dv, Dk]`: one matrix `M[h]` per value head (llama.cpp's ssm cache);
* q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, per-head decay logits g and write strengths beta `[T, Hv]`;
  KDA (kimi-k3) decays each key index apart: g `[T, Hv, Dk]`, `M[h] *= exp(g[t, h])[None, :]`.

`gated_delta_net_ref` is the sequential recurrence (llama.cpp's fused CPU op, the default path);
`gated_delta_net_chunked_ref` is the chunked WY/UT form of the same maths (llama.cpp's non-fused
path), kept as a second spelling that tests hold equal to the first.

Lightning attention (minimax-01, llama.cpp `src/models/minimax-01.cpp`) is linear attention with a
fixed per-head decay and no delta rule: state `[H, Dk, Dv]` (S[h] = sum of decayed k v^T), q, k, v
`[T, H, D]`. llama.cpp runs one call's tokens as one block (`lightning_attention_ref`); the decays
are made in float32 in its order (`lightning_decays`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .op_def import OpDef, ShapeDtype
from .op_def import one_output as _one
from .op_def import same_shape as _same

HEAD_MAPS = ("tiled", "interleaved")
GATE_ACTS = ("silu", "sigmoid")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def k_head_index(head_map: str, n_v_heads: int, n_k_heads: int) -> np.ndarray:
    """For each value head h, the q/k head it reads: tiled `h % Hk` (qwen35, qwen4exp) or
    interleaved `h // (Hv/Hk)` (qwen3next)."""
    h = np.arange(n_v_heads)
    if n_v_heads % n_k_heads:
        raise ValueError(f"value heads ({n_v_heads}) must be a multiple of key heads ({n_k_heads})")
    if head_map == "tiled":
        return h % n_k_heads
    if head_map == "interleaved":
        return h // (n_v_heads // n_k_heads)
    raise ValueError(f"unknown head map {head_map!r} (known: {', '.join(HEAD_MAPS)})")


def l2_norm_ref(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp's GDN l2 norm)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))


def rms_norm_gated_ref(x: np.ndarray, w: np.ndarray, z: np.ndarray, eps: float, act: str) -> np.ndarray:
    """rms_norm(x) * w * act(z): the gated RMSNorm of the delta-net output (per head, last axis)."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps)) * w
    if act == "silu":
        gate = z * _sigmoid(z)
    elif act == "sigmoid":
        gate = _sigmoid(z)
    else:
        raise ValueError(f"unknown gate activation {act!r} (known: {', '.join(GATE_ACTS)})")
    return (y * gate).astype(x.dtype)


def ssm_conv_ref(
    state: np.ndarray, x: np.ndarray, w: np.ndarray, dilation: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over [history | this call's inputs]; returns (new_state, y).

    y[t, c] = sum_j w[c, j] * xin[c, t + j*dilation] with xin = concat(state, x.T) (no flip),
    new_state = the last (K-1)*dilation columns of xin.
    """
    t = x.shape[0]
    n_ch, k = w.shape
    hist = (k - 1) * dilation
    xin = np.concatenate([state.astype(x.dtype), x.T], axis=1)  # [C, hist + T]
    y = np.zeros((t, n_ch), dtype=x.dtype)
    for j in range(k):
        y += (xin[:, j * dilation : j * dilation + t] * w[:, j : j + 1].astype(x.dtype)).T
    new_state = xin[:, xin.shape[1] - hist :] if hist else xin[:, :0]
    return np.ascontiguousarray(new_state), y


def gated_delta_net_ref(
    state: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    head_map: str,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, one token at a time; returns (new_state, o [T, Hv, Dv]).

    M[h] *= exp(g[t, h]) (g [T, Hv, Dk]: along the key axis, M[h][:, j] *= exp(g[t, h, j]));
    d = (v[t, h] - M[h] @ k[t, kh]) * beta[t, h]
    M[h] += outer(d, k[t, kh]);  o[t, h] = (M[h] @ q[t, kh]) * scale
    """
    n_tok, n_v, dv = v.shape
    kmap = k_head_index(head_map, n_v, q.shape[1])
    m = state.astype(v.dtype).copy()
    o = np.zeros((n_tok, n_v, dv), dtype=v.dtype)
    for t in range(n_tok):
        kt, qt = k[t, kmap], q[t, kmap]  # [Hv, Dk]
        m *= np.exp(g[t])[:, None, :] if g.ndim == 3 else np.exp(g[t])[:, None, None]
        d = (v[t] - np.einsum("hij,hj->hi", m, kt)) * beta[t][:, None]
        m += d[:, :, None] * kt[:, None, :]
        o[t] = np.einsum("hij,hj->hi", m, qt) * v.dtype.type(scale)
    return m, o


def gated_delta_net_chunked_ref(
    state: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    head_map: str,
    scale: float,
    chunk: int = 64,
) -> tuple[np.ndarray, np.ndarray]:
    """The same recurrence in chunks (WY/UT transform), as llama.cpp's non-fused path.

    Per chunk and head, with S = M^T [Dk, Dv], gc = cumsum(g) per key index (a per-head g is the
    same decay on every key index), D[i, j, :] = exp(gc[i] - gc[j]) for j <= i:
    A = strict_lower(sum_d beta_i k_i k_j D[i, j]), Tm = (I + A)^-1, U = Tm (beta v),
    W = Tm (beta k exp(gc)), Vn = U - W S, o = scale (q exp(gc)) S + scale lower_incl(sum_d q_i k_j D) Vn,
    S' = exp(gc[-1]) S + (k exp(gc[-1] - gc))^T Vn.
    """
    n_tok, n_v, dv = v.shape
    kmap = k_head_index(head_map, n_v, q.shape[1])
    dt = v.dtype
    dk = q.shape[2]
    gk = g.astype(dt) if g.ndim == 3 else np.repeat(g.astype(dt)[:, :, None], dk, axis=2)
    s = np.swapaxes(state.astype(dt), 1, 2).copy()  # [Hv, Dk, Dv]
    o = np.zeros((n_tok, n_v, dv), dtype=dt)
    for c0 in range(0, n_tok, chunk):
        c1 = min(c0 + chunk, n_tok)
        n = c1 - c0
        incl = np.tril(np.ones((n, n), dtype=bool))
        lower = np.tril(incl, -1)
        for h in range(n_v):
            qh, kh = q[c0:c1, kmap[h]].astype(dt), k[c0:c1, kmap[h]].astype(dt)
            vh, bh = v[c0:c1, h], beta[c0:c1, h].astype(dt)
            gc = np.cumsum(gk[c0:c1, h], axis=0)  # [n, Dk]
            decay = np.exp(np.where(incl[:, :, None], gc[:, None, :] - gc[None, :, :], -np.inf))  # [n, n, Dk]
            a = np.where(lower, np.einsum("id,jd,ijd->ij", bh[:, None] * kh, kh, decay), 0.0)
            tm = np.linalg.inv(np.eye(n, dtype=dt) + a)
            u = tm @ (bh[:, None] * vh)
            wm = tm @ (bh[:, None] * kh * np.exp(gc))
            vn = u - wm @ s[h]
            psi = np.einsum("id,jd,ijd->ij", qh, kh, decay)
            o[c0:c1, h] = dt.type(scale) * ((qh * np.exp(gc)) @ s[h] + psi @ vn)
            s[h] = s[h] * np.exp(gc[-1])[:, None] + (kh * np.exp(gc[-1] - gc)).T @ vn
    return np.ascontiguousarray(np.swapaxes(s, 1, 2)), o


# ---------------------------------------------------------------------------------------------
# lightning attention (minimax-01)


def lightning_slopes(n_head: int) -> tuple[float, ...]:
    """The per-head decay rates as llama.cpp's host input makes them (powf/log2f in float32):
    start = ratio = 2^(-2^(-(log2 H - 3))), slope[h] = start * ratio^h."""
    f = np.float32
    start = f(2) ** -(f(2) ** -(np.log2(f(n_head)) - f(3)))
    return tuple(float(f(start) * f(start) ** f(h)) for h in range(n_head))


def lightning_layer_scale(layer: int, n_layer: int) -> float:
    """The decay multiplier of layer `layer`: 1 - il/(n_layer - 1) + 1e-5 in double, passed as float."""
    return float(np.float32(1.0 - 1.0 * layer / (n_layer - 1) + 1e-5))


def lightning_decays(slopes: tuple[float, ...], layer_scale: float, n: int) -> dict[str, np.ndarray]:
    """A block of n tokens' decay factors, float32 in llama.cpp's order (exponent = slope * count on
    the host, times the layer scale in the graph, then exp): q [n, H] = e^(-s*slope*(i+1)),
    k [n, H] = e^(-s*slope*(n-1-i)), diag [n(query), n(key), H] = e^(-s*slope*(j-i)) for i <= j else
    0, block [H] = e^((s*slope) * -n)."""
    f = np.float32
    sl, s = np.asarray(slopes, f), f(layer_scale)
    i = np.arange(n, dtype=f)[:, None]
    rel = np.arange(n)[:, None] - np.arange(n)[None, :]
    diag_exp = np.where(rel[:, :, None] >= 0, (-sl) * rel[:, :, None].astype(f), f(-np.inf))
    return {
        "q": np.exp(((-sl) * (i + f(1))) * s),
        "k": np.exp(((-sl) * (f(n) - i - f(1))) * s),
        "diag": np.exp(diag_exp * s).astype(f),
        "block": np.exp((sl * s) * f(-n)),
    }


def lightning_attention_ref(
    state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, slopes: tuple[float, ...], layer_scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """One block of lightning attention over a call's T tokens; returns (new_state, o [T, H, Dv]).

    T = 1 (llama.cpp's decode path): S' = S e^(-s*slope) + k v^T, o = q S'.
    T > 1: o = (q * q_decay) S + ((q k^T) * diag) v (the two sums made apart, then added),
    S' = S * block_decay + (k * k_decay)^T v."""
    dt = v.dtype
    n = q.shape[0]
    d = {key: val.astype(dt) for key, val in lightning_decays(slopes, layer_scale, n).items()}
    s_old = state.astype(dt)
    kv = np.einsum("thi,thj->hij", k * d["k"][:, :, None], v) if n > 1 else k[0][:, :, None] * v[0][:, None, :]
    s_new = s_old * d["block"][:, None, None] + kv
    if n == 1:
        return s_new, np.einsum("thi,hij->thj", q, s_new)
    inter = np.einsum("thi,hij->thj", q * d["q"][:, :, None], s_old)
    scores = np.einsum("thd,uhd->htu", q, k) * np.moveaxis(d["diag"], 2, 0)
    intra = np.einsum("htu,uhj->thj", scores, v)
    return s_new, (inter + intra).astype(dt)


# ----------------------------------------------------------------------------------------------
# the family's ops: records (attributes), shape rules and OpDefs, merged into ir/ops.py's OPS


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


def _ref_gated_delta_net(ins: Sequence[np.ndarray], a: GatedDeltaNet) -> list[np.ndarray]:
    state, q, k, v, g, beta = ins
    return list(gated_delta_net_ref(state, q, k, v, g, beta, a.head_map, a.scale))


def _lightning_attention_shape(ins: Sequence[ShapeDtype], a: LightningAttention) -> list[ShapeDtype]:
    (ss, sdt), (qs, _), (ks, _), (vs, _) = ins
    h, dk, dv = ss
    t = qs[0]
    ok = (tuple(qs) == (t, h, dk) and tuple(ks) == tuple(qs) and tuple(vs) == (t, h, dv)
          and len(a.slopes) == h)
    if not ok:
        raise ValueError(f"lightning_attention: state {ss}, q {qs}, k {ks}, v {vs}, {len(a.slopes)} slopes disagree")
    return [(ss, sdt), (vs, "float32")]


def _rms_norm_gated_shape(ins: Sequence[ShapeDtype], a: RMSNormGated) -> list[ShapeDtype]:
    (xs, dt), (ws, _), (zs, _) = ins
    if tuple(ws) != (xs[-1],) or len(zs) != len(xs) or any(p != q for p, q in zip(xs, zs, strict=True)):
        raise ValueError(f"rms_norm_gated: x {xs}, weight {ws} and gate {zs} disagree")
    return [(xs, dt)]


LINEAR_ATTENTION_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        # recurrent state: inputs[0] is the state, outputs[0] its new version
        OpDef("ssm_conv", SsmConv, _ssm_conv_shape,
              lambda i, a, c: list(ssm_conv_ref(i[0], i[1], i[2], a.dilation)), effects=True),
        OpDef("gated_delta_net", GatedDeltaNet, _gated_delta_net_shape,
              lambda i, a, c: _ref_gated_delta_net(i, a), effects=True),
        OpDef("lightning_attention", LightningAttention, _lightning_attention_shape,
              lambda i, a, c: list(lightning_attention_ref(i[0], i[1], i[2], i[3], a.slopes, a.layer_scale)),
              effects=True),
        OpDef("l2_norm", L2Norm, _same, _one(lambda i, a, c: l2_norm_ref(i[0], a.eps)), fused=True),
        # rms_norm_gated: inputs (x, weight, gate)
        OpDef("rms_norm_gated", RMSNormGated, _rms_norm_gated_shape,
              _one(lambda i, a, c: rms_norm_gated_ref(i[0], i[1], i[2], a.eps, a.act)), fused=True),
    ]
}
