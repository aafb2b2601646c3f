"""Non-finite logits, caught as they come out of the kernels (`--check-numerics`).

`NumericsGuard` wraps a Session: every `forward` is checked with one `np.isfinite` over the
logits it returns (cheap beside the forward pass itself) and the tokens fed since the last
reset are remembered, so that when a NaN or Inf appears the exact same context can be replayed
through a probe that names the layer (driver/numerics.py; the runtime imports nothing from the
compiler). Without the flag nothing wraps the session and nothing is checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ggufc.messages import GgufcError


class NonFiniteLogitsError(GgufcError, ValueError):
    """Logits with a NaN or Inf; `tokens` is the context up to and including the token whose
    logits were bad (so replaying `tokens` from an empty context reproduces them)."""

    def __init__(self, tokens: np.ndarray, kind: str) -> None:
        self.tokens = tokens
        self.kind = kind
        self.position = int(tokens.size) - 1
        super().__init__(f"the logits at token {self.position} contain {kind}")


class NumericsGuard:
    """A Session whose logits are checked for NaN/Inf after every call."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._history: list[np.ndarray] = []

    def __getattr__(self, name: str) -> Any:  # n_ctx, n_free, manifest, ... of the session
        return getattr(self._session, name)

    def __enter__(self) -> NumericsGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self._session.close()

    def reset(self) -> None:
        self._session.reset()
        self._history.clear()

    def forward(self, tokens: np.ndarray | list[int], *, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(tokens).reshape(-1)
        logits = self._session.forward(tokens, all_logits=all_logits)
        self._history.append(ids)
        rows = logits.reshape(-1, logits.shape[-1])
        finite_rows = np.isfinite(rows).all(axis=-1)
        if not finite_rows.all():
            self._raise(rows, finite_rows, ids.size, all_logits)
        return logits

    def _raise(self, rows: np.ndarray, finite_rows: np.ndarray, n_fed: int, all_logits: bool) -> None:
        first_bad = int(np.argmin(finite_rows))
        # without all_logits the one row belongs to the last token fed
        position_in_call = first_bad if all_logits else n_fed - 1
        context = np.concatenate(self._history)
        upto = context.size - n_fed + position_in_call + 1
        bad_row = rows[first_bad]
        kind = "NaN" if np.isnan(bad_row).any() else "Inf"
        raise NonFiniteLogitsError(context[:upto].astype(np.int32), kind)
