"""What a tuning session is asked to do, and how it reports a problem."""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ggufc.messages import GgufcError


class TuneError(GgufcError, ValueError):
    """A user-facing tuning problem (no device, bad database, ...): one line."""


@dataclass(frozen=True)
class TuneOptions:
    """MetaSchedule knobs of a session. The defaults suit a 2-16 core CPU; tests shrink them."""

    trials_per_round: int = 16
    population: int = 256  # evolutionary search population
    init_min_unmeasured: int = 32
    genetic_iters: int = 3
    max_trials_per_kernel: int = 1024
    seed: int = 0
    # ggufc's own timing of default and tuned kernels: rounds of interleaved A/B measurements
    timing_rounds: int = 5
    min_repeat_ms: int = 20
    # "cold": weight-reading kernels (timed_cold) are timed with their arguments flushed from the
    # CPU caches before each call, as a decode step of a model bigger than the last-level cache
    # reads them; "hot": the same cached arguments each call. tune_model resolves "auto".
    timing: str = "hot"

    @staticmethod
    def for_round(trials_per_round: int, **overrides: Any) -> TuneOptions:
        """Options whose search population suits rounds of `trials_per_round` candidates."""
        n = int(trials_per_round)
        base = {"trials_per_round": n, "population": max(64, 16 * n), "init_min_unmeasured": max(8, 2 * n)}
        return TuneOptions(**{**base, **overrides})
