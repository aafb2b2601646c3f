"""Greedy speculative decoding: draft a few tokens cheaply, verify them in one multi-token forward,
keep the longest prefix the model agrees with and cut the context back to it.

The output is plain greedy's: every emitted token is the argmax of the target model's logits
after exactly the tokens before it. The verify step asks the session to keep the recurrent
states after each drafted token (`forward(keep_rollback=K)`), so cutting back a rejection is a
copy (`Session.stats.rollback_copies`), never a replay.

Drafters: `NgramDrafter` (prompt lookup: the tokens that followed the latest earlier occurrence
of the context's last n-gram) and `ModelDrafter` (a smaller model's greedy continuation, its own
session kept on the same tokens by truncating to the common prefix).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ggufc.messages import progress

from .session import ContextOverflowError, Session


class Drafter(Protocol):
    def propose(self, history: np.ndarray, k: int) -> list[int]: ...


@dataclass
class NgramDrafter:
    """Prompt-lookup drafts: match the last `n_max` .. `n_min` tokens earlier in the history."""

    n_max: int = 3
    n_min: int = 1

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        h = np.asarray(history)
        for n in range(min(self.n_max, h.size - 1), self.n_min - 1, -1):
            tail = h[h.size - n :]
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # starts 0 .. size-1-n
            hits = np.flatnonzero(np.all(windows == tail, axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in h[start : start + k]]
        return []


class ModelDrafter:
    """A second model with the same vocabulary drafts greedily from the same context."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        s = self.session
        k = min(k, s.n_ctx - history.size)
        if k <= 0:
            return []
        s.reuse_prefix(history)
        logits = s.forward(history[s.n_past :])
        out: list[int] = []
        while True:
            out.append(int(np.argmax(logits)))
            if len(out) == k:
                return out
            logits = s.forward([out[-1]])


@dataclass
class SpeculativeStats:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify forwards of the target model
    rejections: int = 0  # steps that cut drafted tokens back
    generated: int = 0
    seconds: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def speculative_greedy(session: Session, prompt_ids: Sequence[int] | np.ndarray, drafter: Drafter, *,
                       max_new_tokens: int, draft_tokens: int = 4, stop_ids: Iterable[int] = (),
                       stats: SpeculativeStats | None = None) -> Iterator[int]:
    """Token ids of plain greedy decoding after `prompt_ids` (fed after the session's context),
    verified `draft_tokens` at a time (`stats.seconds`: the time after the prompt). Stops before a
    stop id, after `max_new_tokens`, or when the context is full."""
    stats = stats if stats is not None else SpeculativeStats()
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("speculative decoding needs at least one prompt token")
    if prompt.size > session.n_free:
        raise ContextOverflowError(
            f"prompt is {prompt.size} tokens, but the context has {session.n_free} of {session.n_ctx} free")
    stops = {int(s) for s in stop_ids}
    current = int(np.argmax(session.forward(prompt)))
    t0 = time.perf_counter()  # generation time, without the prompt (as plain greedy is timed)
    produced = 0
    try:
        while True:
            if current in stops or produced == max_new_tokens:
                return
            produced += 1
            stats.generated += 1
            yield current
            room = min(draft_tokens, max_new_tokens - produced, session.n_free - 1)
            if room < 0:
                progress(f"context full ({session.n_ctx} tokens); stopping generation")
                return
            history = np.append(session.tokens, current)
            draft = drafter.propose(history, room) if room > 0 else []
            base = session.n_past
            if draft:
                rows = session.forward([current, *draft], all_logits=True, keep_rollback=len(draft))
            else:  # nothing to check: the decode step itself (a one-row prompt call may sum in another order)
                rows = session.forward([current])[None]
            best = rows.argmax(axis=-1)
            accepted = 0
            while accepted < len(draft) and draft[accepted] == int(best[accepted]):
                accepted += 1
            stats.steps += 1
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.rejections += accepted < len(draft)
            session.truncate(base + 1 + accepted)
            for token in draft[:accepted]:
                if token in stops or produced == max_new_tokens:
                    return
                produced += 1
                stats.generated += 1
                yield token
            current = int(best[accepted])
    finally:
        stats.seconds += time.perf_counter() - t0
