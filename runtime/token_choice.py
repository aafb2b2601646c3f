"""The next token of one sequence, as OpenAI's API defines the choice: the model's logits, then
`logit_bias`, presence / frequency penalties over the tokens generated so far and a grammar's mask
(structured_output.py), then the sampler; and the chosen token's log-probability with the most
likely alternatives when asked.

Log-probabilities are the model's own (log_softmax of the raw logits, before bias, penalties,
grammar and temperature), as vLLM reports them by default: they say how likely the model found
each token, whatever steered the choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from .sampling import Sampler

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)


class Constraint(Protocol):
    """A grammar over the generated tokens (structured_output.GrammarConstraint)."""

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf, in place."""
        ...

    def accept(self, token: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How a request steers its tokens beyond the sampler (all off by default)."""

    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and k others
    constraint: Callable[[], Constraint] | None = None  # a fresh grammar state per sequence

    @property
    def steers(self) -> bool:
        """Whether the sampler sees other scores than the model's logits."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.constraint is not None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `top` most likely tokens' (id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenChooser:
    """One sequence's token choices: the sampler's rng, the counts of generated tokens and the
    grammar's state live here, so a sequence is reproducible from its seed alone."""

    def __init__(self, sampler: Sampler, decoding: Decoding = Decoding()) -> None:
        self.sampler = sampler
        self.decoding = decoding
        self.constraint = decoding.constraint() if decoding.constraint is not None else None
        self._counts: dict[int, int] = {}
        self._bias_ids = np.fromiter(decoding.logit_bias.keys(), dtype=np.int64, count=len(decoding.logit_bias))
        self._bias_values = np.fromiter(decoding.logit_bias.values(), dtype=np.float32,
                                        count=len(decoding.logit_bias))

    def choose(self, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token and, when the request asked for them, its log-probabilities."""
        raw = np.asarray(logits).reshape(-1)
        token = self.sampler(self.scores(raw) if self.decoding.steers else raw)
        if self.constraint is not None:
            self.constraint.accept(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        k = self.decoding.top_logprobs
        return token, (None if k is None else token_logprob(raw, token, k))

    def scores(self, raw: np.ndarray) -> np.ndarray:
        """The logits the sampler sees: biased, penalised, masked (a copy; `raw` is left alone)."""
        scores = raw.astype(np.float32, copy=True)
        if self._bias_ids.size:
            scores[self._bias_ids] += self._bias_values
        d = self.decoding
        if self._counts and (d.presence_penalty or d.frequency_penalty):
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            scores[ids] -= counts * np.float32(d.frequency_penalty) + np.float32(d.presence_penalty)
        if self.constraint is not None:
            self.constraint.mask(scores)
        return scores


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """log_softmax(logits) at `token`, and the k largest (ties by lower id), in float64."""
    scores = np.asarray(logits, dtype=np.float64).reshape(-1)
    peak = scores.max()
    log_total = peak + np.log(np.exp(scores - peak).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, scores.size)
        part = np.argpartition(-scores, k - 1)[:k]
        order = part[np.lexsort((part, -scores[part]))]
        top = tuple((int(i), float(scores[i] - log_total)) for i in order)
    return TokenLogprob(int(token), float(scores[token] - log_total), top)
