"""The context behind a session's states: the tokens fed so far, what each state is, and the
copies of recurrent state that let the context be cut back.

Each manifest state has a kind (written by the compiler from how the graph writes the state):

- `per_position`: cell i holds what token i produced (attention K/V, indexer keys, latent caches,
  token histories). Keeping the first n tokens keeps cells [0, n) and clears the rest, so every
  such cache follows the attention cache cell for cell by construction.
- `recurrent`: a value that summarises every token so far (delta-net, conv and rolling
  histories). It cannot be cut, so the session keeps checkpoints: a copy after every
  `interval` tokens (at positions that are multiples of it), and, when a forward asks for
  `keep_rollback=K`, a copy after each of its last K tokens. Truncating to n restores the copy
  at n when there is one (speculative rollback: a copy, no compute), else the nearest checkpoint
  c <= n, and replays tokens [c, n): at most `interval - 1` tokens, in chunks. The checkpoints
  cost `n_past / interval` copies of the recurrent states (`checkpoint_bytes`).
- `scratch`: rewritten by every call (a step's own inputs); never copied.
- `window`: a sliding-window layer's K/V cache of a few cells (artifact.WindowCells): the last
  `size - 1 + margin` positions or more, which the session moves to the next call's layout after
  each call. A cut back by up to `margin` tokens keeps what the window needs (a move of cells);
  a deeper one cannot regrow the cells dropped before, so the session replays the context from
  its start (llama.cpp re-processes the prompt likewise where it keeps no SWA checkpoint).

Where the recurrent numerics depend on how tokens are split into calls (lightning attention makes a
call one block; KDA's chunked form chunks from a call's start), the manifest's `ubatch` says so: a
prompt is then cut only at multiples of it, as llama.cpp cuts its batch at n_ubatch, and the
checkpoints are taken where calls end anyway: at those multiples, at the end of every forward of
more than one token, and at multiples of `interval` among one-token calls (decoding).

Artifacts from before kinds were recorded treat every state as recurrent (correct, costlier).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .artifact import STATE_KINDS

PER_POSITION, RECURRENT, SCRATCH = STATE_KINDS
MIN_CHECKPOINT_INTERVAL = 64
MAX_CHECKPOINTS = 32  # the default interval keeps at most this many over a full context


def state_kinds(manifest: dict[str, Any]) -> list[str]:
    """The kind of every manifest state (already checked by the artifact reader)."""
    return [str(s.get("kind", RECURRENT)) for s in manifest["states"]]


def default_interval(n_ctx: int) -> int:
    """Tokens between checkpoints: at least 64, and at most MAX_CHECKPOINTS over the context."""
    per = -(-n_ctx // MAX_CHECKPOINTS)
    return max(MIN_CHECKPOINT_INTERVAL, -(-per // MIN_CHECKPOINT_INTERVAL) * MIN_CHECKPOINT_INTERVAL)


@dataclass
class ContextStats:
    """What truncation cost so far (also what tests and `--speculate` report)."""

    truncations: int = 0
    cuts: int = 0  # truncations that only moved the end (no recurrent state, or nothing to restore)
    rollback_copies: int = 0  # restored from a copy kept by forward(keep_rollback=K): no compute
    checkpoint_restores: int = 0  # restored from a periodic checkpoint, then replayed
    replayed_tokens: int = 0
    checkpoints_taken: int = 0
    window_replays: int = 0  # cut a window cache below the cells it keeps: replayed from the start

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class ContextHistory:
    """Tokens in the context and copies of the recurrent states by position."""

    n_ctx: int
    interval: int
    tokens: np.ndarray = field(init=False)
    checkpoints: dict[int, list[np.ndarray]] = field(default_factory=dict)
    rollback: dict[int, list[np.ndarray]] = field(default_factory=dict)
    stats: ContextStats = field(default_factory=ContextStats)

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"checkpoint interval must be positive, got {self.interval}")
        self.tokens = np.zeros(self.n_ctx, np.int32)

    def clear(self) -> None:
        self.checkpoints.clear()
        self.rollback.clear()

    def forget_after(self, n: int) -> None:
        """Copies made after position n describe tokens that are no longer in the context."""
        for store in (self.checkpoints, self.rollback):
            for pos in [p for p in store if p > n]:
                del store[pos]

    def nearest(self, n: int) -> tuple[int, list[np.ndarray] | None, bool]:
        """(position, copy, from_rollback) to restore for a context of n tokens; copy None: zeros."""
        if n in self.rollback:
            return n, self.rollback[n], True
        below = [p for p in self.checkpoints if p <= n]
        if not below:
            return 0, None, False
        best = max(below)
        return best, self.checkpoints[best], False

    def checkpoint_bytes(self) -> int:
        return sum(a.nbytes for store in (self.checkpoints, self.rollback) for c in store.values() for a in c)


def split_points(start: int, n: int, max_chunk: int, interval: int | None, singles_from: int,
                 ubatch: int | None = None) -> list[int]:
    """Chunk ends (absolute positions) for feeding tokens [start, start + n): at most `max_chunk`
    per call, a boundary at every multiple of `interval` (checkpoints), and one token per call from
    position `singles_from` on (copies after each of the last tokens). With `ubatch` (models whose
    recurrent numerics depend on the split), the boundaries are its multiples instead, as
    llama.cpp cuts a prompt into ubatches."""
    end = start + n
    if ubatch:
        ends = set(range((start // ubatch + 1) * ubatch, end, ubatch))
    else:
        ends = set(range(start + max_chunk, end, max_chunk))
    if interval and not ubatch:
        ends.update(range((start // interval + 1) * interval, end, interval))
    ends.update(range(max(singles_from, start + 1), end))
    ends.add(end)
    return sorted(ends)


def common_prefix(have: np.ndarray, want: np.ndarray) -> int:
    """How many leading tokens two token lists share."""
    n = min(have.size, want.size)
    differ = np.flatnonzero(have[:n] != want[:n])
    return int(differ[0]) if differ.size else n
