"""Hyper-connections: numpy references (llama.cpp `ggml_dsv4_hc_pre_gated` / `ggml_dsv4_hc_post`)
and the spellings in primitives of the `hc_pre` and `hc_post` ops.

Hyper-connections keep `hc` residual streams R [T, hc, E]:

* `hc_pre` (qwen4exp): per-stream RMSNorm times a [hc, E] gamma, flattened stream-major to
  xf [T, hc*E]; gate = silu((xf @ down.T) / hc) @ up.T; the layer input is
  mean_c(xf * sigmoid(gate)) [T, E]; the per-stream post weights are 2*sigmoid((xf @ inject.T) / hc).
  The final collapse (no inject) has no post weights.
* `hc_sinkhorn` (deepseek4): the Sinkhorn-normalised full-rank mix (outputs mixed, post and a
  [T, hc, hc] comb matrix; the final collapse: mixed only).
* `hc_post`: R + post[:, :, None] * y[:, None, :]; with a comb matrix [T, src, dst] (deepseek4)
  post * y + sum over src of comb[t, src, dst] * R[t, src].

* `res_mix` (kimi-k3's cross-layer residual attention): a softmax over banked layer inputs
  src [T, n, E] and the current stream cur [T, E], scored by sum(rms(x) * w); the mix of the raw
  values sum_c p[c] * src[:, c] + p[-1] * cur.

Their spellings in primitives are in `hyper_connections_spelled.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .op_def import OpDef, ShapeDtype
from .op_def import one_output as _one
from .ref_math import rms_plain, sigmoid, silu


def hc_pre_ref(ins: Sequence[np.ndarray], n_hc: int, eps: float, post: bool) -> list[np.ndarray]:
    """Inputs (R [T,hc,E], norm [hc,E], down [lr,hc*E], up [hc*E,lr][, inject [hc,hc*E]])."""
    r, norm, down, up, *rest = ins
    t, hc, e = r.shape
    dt = r.dtype.type
    xf = (rms_plain(r, eps) * norm).reshape(t, hc * e)
    lo = silu((xf @ down.T) * dt(1.0 / n_hc))
    gate = lo @ up.T
    mixed = np.mean((xf * sigmoid(gate)).reshape(t, hc, e), axis=1)
    if not post:
        return [mixed]
    (inject,) = rest
    w = dt(2.0) * sigmoid((xf @ inject.T) * dt(1.0 / n_hc))
    return [mixed, w]


def hc_sinkhorn_ref(r: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, *, n_hc: int, eps: float,
                    hc_eps: float, n_iter: int, post: bool) -> list[np.ndarray]:
    """deepseek4's mix (llama.cpp ggml_dsv4_hc_pre / hc_comb): mixes = rms(flat R) @ fn.T; pre =
    sigmoid(mixes[:hc] * scale[0] + base) + hc_eps mixes the streams; post = 2 * sigmoid(...);
    comb [T, src, dst] = softmax over dst + hc_eps, then column (src) sums + hc_eps divide, then
    `n_iter - 1` rounds of row (dst) then column normalisation."""
    t, hc, e = r.shape
    dt = r.dtype.type
    mixes = rms_plain(r.reshape(t, hc * e), eps) @ fn.T
    pre = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + dt(hc_eps)
    mixed = np.einsum("th,the->te", pre, r)
    if not post:
        return [mixed]
    post_w = dt(2.0) * sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(t, hc, hc)
    ex = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = ex / ex.sum(axis=-1, keepdims=True) + dt(hc_eps)
    comb = comb / (comb.sum(axis=1, keepdims=True) + dt(hc_eps))
    for _ in range(n_iter - 1):
        comb = comb / (comb.sum(axis=2, keepdims=True) + dt(hc_eps))
        comb = comb / (comb.sum(axis=1, keepdims=True) + dt(hc_eps))
    return [mixed, post_w, comb]


def hc_post_ref(r: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray | None = None) -> np.ndarray:
    """R [T,hc,E], y [T,E], post [T,hc][, comb [T,hc(src),hc(dst)] (ggml_dsv4_hc_post's [dst,src,T])]
    -> [T,hc,E]: post * y plus, per destination stream, the comb-weighted sum of the source streams."""
    scattered = post[:, :, None] * y[:, None, :]
    if comb is None:
        return r + scattered
    return scattered + np.einsum("tsd,tse->tde", comb, r)


def res_mix_ref(src: np.ndarray, cur: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """src [T,n,E] banked layer inputs, cur [T,E], score weight w [E] -> [T,E]."""
    scores = np.concatenate([(rms_plain(src, eps) * w).sum(-1), (rms_plain(cur, eps) * w).sum(-1, keepdims=True)], 1)
    e = np.exp(scores - scores.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    n = src.shape[1]
    return np.einsum("tc,tce->te", p[:, :n], src) + p[:, n:] * cur


# ----------------------------------------------------------------------------------------------
# the family's ops: records (attributes), shape rules and OpDefs, merged into ir/ops.py's OPS


@dataclass(frozen=True)
class HcPre:
    """Hyper-connection pre-mix of the [T, hc, E] streams into a layer input [T, E] (qwen4exp's
    low-rank sigmoid-gated mean): inputs (R, norm [hc,E], down [lr,hc*E], up [hc*E,lr]
    [, inject [hc,hc*E]]); outputs (mixed [T,E][, post [T,hc] = 2*sigmoid(inject(xf)/hc)]).
    """

    n_hc: int
    eps: float
    post: bool = True  # False: the final collapse (no inject, no post weights)


@dataclass(frozen=True)
class HcSinkhorn:
    """deepseek4's full-rank hyper-connection mix: inputs (R [T,hc,E], fn [(2+hc)*hc, hc*E] (post)
    or [hc, hc*E] (collapse), scale [3] or [1], base like fn's rows); outputs (mixed [T,E][, post
    [T,hc], comb [T,hc(src),hc(dst)]]), the comb Sinkhorn-normalised for an `hc_post` with comb=True.
    """

    n_hc: int
    eps: float
    hc_eps: float  # added to the pre weights and in every normalisation
    n_iter: int = 0  # Sinkhorn rounds (the first is the column normalisation alone); 0 for the collapse
    post: bool = True  # False: the final collapse (pre weights only)


@dataclass(frozen=True)
class HcPost:
    """R [T,hc,E] + post [T,hc] * y [T,E] per stream (comb=True: R mixed by a [T,hc(src),hc(dst)] comb)."""

    comb: bool = False


@dataclass(frozen=True)
class ResMix:
    """Cross-layer residual attention: (src [T,n,E] banked inputs, cur [T,E], score weight [E]) ->
    softmax-of-(sum(rms(x) * w)) mix of the raw src rows and cur [T,E]."""

    eps: float


def _hc_sinkhorn_shape(ins: Sequence[ShapeDtype], a: HcSinkhorn) -> list[ShapeDtype]:
    (rs, dt), (fs, _), (ss, _), (bs, _) = ins
    t, hc, e = rs
    n_mix = (2 + a.n_hc) * a.n_hc if a.post else a.n_hc
    ok = hc == a.n_hc and tuple(fs) == (n_mix, hc * e) and tuple(ss) == ((3,) if a.post else (1,))
    if not ok or tuple(bs) != (n_mix,) or (a.post and a.n_iter < 1):
        raise ValueError(f"hc_sinkhorn {a}: streams {rs}, weights {[s for s, _ in ins[1:]]} disagree")
    if not a.post:
        return [((t, e), dt)]
    return [((t, e), dt), ((t, hc), dt), ((t, hc, hc), dt)]


def _hc_pre_shape(ins: Sequence[ShapeDtype], a: HcPre) -> list[ShapeDtype]:
    (rs, dt), (ns, _), (ds, _), (us, _), *rest = ins
    t, hc, e = rs
    ok = hc == a.n_hc and tuple(ns) == (hc, e) and ds[1] == hc * e and tuple(us) == (hc * e, ds[0])
    ok = ok and len(rest) == (1 if a.post else 0)
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


HC_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        OpDef("hc_pre", HcPre, _hc_pre_shape, lambda i, a, c: hc_pre_ref(i, a.n_hc, a.eps, a.post), fused=True),
        OpDef("hc_sinkhorn", HcSinkhorn, _hc_sinkhorn_shape,
              lambda i, a, c: hc_sinkhorn_ref(*i, n_hc=a.n_hc, eps=a.eps, hc_eps=a.hc_eps, n_iter=a.n_iter,
                                              post=a.post),
              fused=True),
        OpDef("hc_post", HcPost, _hc_post_shape,
              _one(lambda i, a, c: hc_post_ref(i[0], i[1], i[2], i[3] if a.comb else None)), fused=True),
        OpDef("res_mix", ResMix, _res_mix_shape, _one(lambda i, a, c: res_mix_ref(i[0], i[1], i[2], a.eps)),
              fused=True),
    ]
}
