"""Several sessions of one artifact (the slots of `ggufc serve`): one copy of the kernels and
weights for all of them, and their next tokens decoded in one batched step.

Each slot is a full `Session` (its own context, truncation, prefix reuse, state files). On the
CPU their states are stacked: state j of every slot is one array [S, ...] and slot i's session
works on block i, so the artifact's `decode_batch` entry point (codegen/batch_rows.py) can take
one token of each of several slots in one call, every weight read once for all of them. Artifacts
without that entry point (recurrent or sparse-attention architectures, GPU targets) say why in
`batch_refused`, and their slots decode one call each.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .artifact import aligned_empty
from .session import Session, StackedStates

DECODE_BATCH = "decode_batch"


class SlotGroup:
    """`n_slots` sessions of `artifact` sharing kernels and weights; `decode_batch` steps several."""

    def __init__(self, artifact: str | os.PathLike[str], n_slots: int, *, device: str = "cpu",
                 threads: int | None = None) -> None:
        if n_slots < 1:
            raise ValueError(f"a slot group needs at least one slot, got {n_slots}")
        self._stack = StackedStates(n_slots)
        self._artifact, self._device, self._threads = artifact, device, threads
        self._embedder: Session | None = None
        first = Session(artifact, device=device, threads=threads, stack=(self._stack, 0))
        self.sessions = [first]
        try:
            for slot in range(1, n_slots):
                self.sessions.append(Session(artifact, device=device, threads=threads, weights=first._weights,
                                             stack=(self._stack, slot)))
        except BaseException:
            self.close()
            raise
        self.n_vocab = first.n_vocab
        self.batch_refused = self._refusal(first.manifest, device)
        self._rows = {name: aligned_empty(n_slots, np.int32) for name in ("tokens", "positions", "slots")}

    def _refusal(self, manifest: dict[str, Any], device: str) -> str | None:
        if DECODE_BATCH not in manifest["functions"]:
            why = manifest.get("decode_batch_refused") or "the artifact has no batched decode entry point"
            return str(why)
        if device != "cpu":
            return f"batched decode runs on the CPU; {device} slots decode one call each"
        return self._stack.refused

    def decode_batch(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        """Feed token t to slot s for every (s, t) in `steps` (distinct slots) in one call; returns
        float32 logits [len(steps), n_vocab], row i what slot s's own `forward([t])` returns."""
        if self.batch_refused is not None:
            raise RuntimeError(f"no batched decode: {self.batch_refused}")
        slots = [int(s) for s, _ in steps]
        if not slots or len(set(slots)) != len(slots) or not all(0 <= s < len(self.sessions) for s in slots):
            raise ValueError(f"decode_batch needs distinct slots in [0, {len(self.sessions)}), got {slots}")
        sessions = [self.sessions[s] for s in slots]
        tokens = [int(t) for _, t in steps]
        positions = [session._before_batch_step(t) for session, t in zip(sessions, tokens, strict=True)]
        n = len(steps)
        for name, values in (("tokens", tokens), ("positions", positions), ("slots", slots)):
            self._rows[name][:n] = values
        out = self._call(n, sessions[0])
        for session, token in zip(sessions, tokens, strict=True):
            session._after_batch_step(token)
        return out

    def _call(self, n: int, loaded: Session) -> np.ndarray:
        import tvm

        rows = [tvm.runtime.from_dlpack(self._rows[name][:n]) for name in ("tokens", "positions", "slots")]
        out = loaded._functions[DECODE_BATCH](*rows, self._stack.tensors(), *loaded._params)
        return np.from_dlpack(out).reshape(n, self.n_vocab).astype(np.float32, copy=False)

    def embedder(self) -> Session:
        """A session of its own for embeddings (its states apart from every slot's, the weights
        shared), opened on first use."""
        if self._embedder is None:
            self._embedder = Session(self._artifact, device=self._device, threads=self._threads,
                                     weights=self.sessions[0]._weights)
        return self._embedder

    def _all_sessions(self) -> list[Session]:
        return [*self.sessions, *([self._embedder] if self._embedder is not None else [])]

    def release_device(self) -> None:
        """Every slot gives its memory back (the weights go when the last one does)."""
        for session in self._all_sessions():
            session.release_device()

    def restore_device(self) -> None:
        for session in self._all_sessions():
            session.restore_device()

    def memory(self) -> dict[str, int]:
        return self.sessions[0].memory()

    def close(self) -> None:
        for session in self._all_sessions():
            session.close()
