"""Embeddings from a decoder model: its final hidden states (`Session.hidden_states`, the final
norm's output) pooled over an input's tokens as llama.cpp's `--pooling` does, `last` (the last
token's state, its default for decoder models) or `mean`, then scaled to unit Euclidean length
as llama-server's /v1/embeddings returns them (`embd_normalize` 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

POOLINGS = ("last", "mean")
DEFAULT_POOLING = "last"


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r:.40} (known: {', '.join(POOLINGS)})")
    return pooling


class Pooler:
    """One input's pooled state, fed its hidden-state rows chunk by chunk."""

    def __init__(self, pooling: str) -> None:
        self.pooling = check_pooling(pooling)
        self._sum: np.ndarray | None = None  # mean: the rows' sum, in float64
        self._last: np.ndarray | None = None
        self.count = 0

    def add(self, rows: np.ndarray) -> None:
        if rows.shape[0] == 0:
            return
        self._last = np.array(rows[-1], dtype=np.float32)  # a copy: the kernels' buffer is reused
        total = rows.astype(np.float64).sum(axis=0)
        self._sum = total if self._sum is None else self._sum + total
        self.count += int(rows.shape[0])

    def result(self, normalize: bool = True) -> np.ndarray:
        if self._sum is None or self._last is None:
            raise ValueError("nothing to pool: the input has no tokens")
        pooled = self._last.astype(np.float64) if self.pooling == "last" else self._sum / self.count
        return unit_length(pooled) if normalize else pooled.astype(np.float32)


def pool(rows: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    """The embedding of one input from its hidden states [T, n_embd]."""
    pooler = Pooler(pooling)
    pooler.add(rows)
    return pooler.result(normalize)


def unit_length(vector: np.ndarray) -> np.ndarray:
    """`vector` / its Euclidean norm, as float32 (a zero vector stays zero, as in llama.cpp)."""
    norm = float(np.linalg.norm(vector))
    return (vector / norm if norm > 0 else vector).astype(np.float32)


def embed_ids(session: Any, ids: Sequence[int] | np.ndarray, pooling: str = DEFAULT_POOLING,
              normalize: bool = True) -> np.ndarray:
    """The embedding of `ids` read into `session` from an empty context (its context is reset
    first and left holding `ids`)."""
    check_pooling(pooling)
    session.reset()
    return pool(session.hidden_states(ids), pooling, normalize)
