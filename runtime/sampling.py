"""Pick the next token from logits: greedy, or temperature / top-k / top-p sampling with a seed."""

from __future__ import annotations

import numpy as np


class Sampler:
    """temperature 0 is greedy (argmax, lowest id on ties); otherwise sample from
    softmax(logits / temperature) restricted to the `top_k` most likely ids (0 = all) and then
    to the smallest set whose probability reaches `top_p` (1.0 = all). The same seed gives the
    same choices for the same logits."""

    def __init__(
        self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None
    ) -> None:
        if not (temperature >= 0.0 and np.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no limit), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:  # one pass over the logits as they are (a wider copy orders them alike)
            return _argmax(np.asarray(logits).reshape(-1))
        scores = np.asarray(logits, dtype=np.float64).reshape(-1)
        if scores.size == 0 or np.isnan(scores).any():
            raise ValueError("logits are empty or contain NaN")
        ids, probs = self.distribution(scores)
        pick = int(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right"))
        return int(ids[min(pick, ids.size - 1)])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidate ids and their renormalised probabilities (most likely first when
        top-k or top-p restrict the support; in id order otherwise, which skips a sort)."""
        scores = np.asarray(logits, dtype=np.float64).reshape(-1) / max(self.temperature, 1e-8)
        restricted = 0 < self.top_k < scores.size or self.top_p < 1.0
        ids = _top_ids(scores, self.top_k) if restricted else np.arange(scores.size)
        kept = scores[ids]
        peak = kept.max()
        if not np.isfinite(peak):
            raise ValueError("logits have no finite maximum")
        probs = np.exp(kept - peak)  # shifted by the maximum: no overflow
        probs /= probs.sum()
        if self.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always at least one id).
            n_keep = int(np.searchsorted(np.cumsum(probs), self.top_p, side="left")) + 1
            ids, probs = ids[:n_keep], probs[:n_keep] / probs[:n_keep].sum()
        return ids, probs


def _argmax(scores: np.ndarray) -> int:
    """The id of the largest score, the lowest on ties; numpy's argmax stops at the first NaN, so
    a NaN anywhere is the one it returns."""
    if scores.size == 0:
        raise ValueError("logits are empty")
    best = int(np.argmax(scores))
    if np.isnan(scores[best]):
        raise ValueError("logits contain NaN")
    return best


def _top_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest scores (all when k is 0), largest first, ties by lower id."""
    if 0 < k < scores.size:
        part = np.argpartition(-scores, k - 1)[:k]
        return part[np.lexsort((part, -scores[part]))]
    return np.argsort(-scores, kind="stable")
