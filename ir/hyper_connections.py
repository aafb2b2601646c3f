"""Hyper-connections: numpy references (llama.cpp `ggml_dsv4_hc_pre_gated` / `ggml_dsv4_hc_post`)
and the spellings in primitives of the `hc_pre` and `hc_post` ops.

Hyper-connections keep `hc` residual streams R [T, hc, E]:

* `hc_pre` (rule "sigmoid_mean", qwen4exp): per-stream RMSNorm times a [hc, E] gamma, flattened
  stream-major to xf [T, hc*E]; gate = silu((xf @ down.T) / hc) @ up.T; the layer input is
  mean_c(xf * sigmoid(gate)) [T, E]; the per-stream post weights are 2*sigmoid((xf @ inject.T) / hc).
  The final collapse (no inject) has no post weights. deepseek4's Sinkhorn-normalised full-rank
  mix is rule "sinkhorn" of the same op (outputs mixed, post and a [T, hc, hc] comb matrix).
* `hc_post`: R + post[:, :, None] * y[:, None, :] (+ comb mixing of R when the rule has one).

* `res_mix` (kimi-k3's cross-layer residual attention): a softmax over banked layer inputs
  src [T, n, E] and the current stream cur [T, E], scored by sum(rms(x) * w); the mix of the raw
  values sum_c p[c] * src[:, c] + p[-1] * cur.

Their spellings in primitives are in `hyper_connections_spelled.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .ref_math import rms_plain, sigmoid, silu


def hc_pre_ref(ins: Sequence[np.ndarray], n_hc: int, eps: float, rule: str, post: bool) -> list[np.ndarray]:
    """Inputs (R [T,hc,E], norm [hc,E], down [lr,hc*E], up [hc*E,lr][, inject [hc,hc*E]])."""
    if rule != "sigmoid_mean":
        raise NotImplementedError(f"hc_pre rule {rule!r} has no reference yet (known: sigmoid_mean)")
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


def hc_post_ref(r: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray | None = None) -> np.ndarray:
    """R [T,hc,E], y [T,E], post [T,hc][, comb [T,hc(dst),hc(src)]] -> [T,hc,E]."""
    mixed = r if comb is None else np.einsum("tds,tse->tde", comb, r)
    return mixed + post[:, :, None] * y[:, None, :]


def res_mix_ref(src: np.ndarray, cur: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """src [T,n,E] banked layer inputs, cur [T,E], score weight w [E] -> [T,E]."""
    scores = np.concatenate([(rms_plain(src, eps) * w).sum(-1), (rms_plain(cur, eps) * w).sum(-1, keepdims=True)], 1)
    e = np.exp(scores - scores.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    n = src.shape[1]
    return np.einsum("tc,tce->te", p[:, :n], src) + p[:, n:] * cur
