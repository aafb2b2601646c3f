"""Sampler: greedy is argmax, seeds reproduce, top-k / top-p restrict the support."""

from __future__ import annotations

import numpy as np
import pytest

from ggufc.runtime.sampling import Sampler

LOGITS = np.array([0.1, 2.0, -1.0, 1.5, 3.0, 0.0, 2.9, -5.0], dtype=np.float32)


def draws(sampler: Sampler, logits: np.ndarray, n: int = 400) -> list[int]:
    return [sampler(logits) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    rng = np.random.default_rng(1)
    sampler = Sampler()
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32)
        assert sampler(logits) == int(np.argmax(logits))


def test_greedy_ties_pick_lowest_id() -> None:
    assert Sampler()(np.array([1.0, 3.0, 3.0, 0.0])) == 1


def test_seeded_sampling_reproducible() -> None:
    first = draws(Sampler(temperature=0.8, seed=123), LOGITS)
    again = draws(Sampler(temperature=0.8, seed=123), LOGITS)
    other = draws(Sampler(temperature=0.8, seed=124), LOGITS)
    assert first == again
    assert first != other
    assert len(set(first)) > 2  # it really samples


def test_top_k_restricts_support() -> None:
    seen = set(draws(Sampler(temperature=5.0, top_k=3, seed=0), LOGITS))
    assert seen == {4, 6, 1}  # the three largest logits


def test_top_k_one_is_greedy() -> None:
    assert set(draws(Sampler(temperature=2.0, top_k=1, seed=0), LOGITS, 50)) == {4}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    sampler = Sampler(temperature=1.0, top_p=0.6, seed=0)
    ids, probs = sampler.distribution(LOGITS)
    full = np.exp(LOGITS - LOGITS.max()) / np.exp(LOGITS - LOGITS.max()).sum()
    order = np.argsort(-full)
    n_needed = int(np.searchsorted(np.cumsum(full[order]), 0.6)) + 1
    assert list(ids) == list(order[:n_needed])
    assert probs.sum() == pytest.approx(1.0)
    assert set(draws(sampler, LOGITS)) == set(order[:n_needed].tolist())


def test_tiny_top_p_still_keeps_one() -> None:
    assert set(draws(Sampler(temperature=1.0, top_p=1e-9, seed=3), LOGITS, 50)) == {4}


def test_frequencies_follow_softmax() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    counts = np.bincount(draws(Sampler(temperature=1.0, seed=5), logits, 20000), minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.02)


def test_masked_logits_never_drawn() -> None:
    logits = np.array([0.0, -np.inf, 0.0, -np.inf])
    assert set(draws(Sampler(temperature=1.0, seed=9), logits, 200)) == {0, 2}


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}],
)
def test_bad_settings_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Sampler(**kwargs)


def test_nan_logits_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        Sampler(temperature=1.0)(np.array([0.0, np.nan]))


@pytest.mark.parametrize("where", [0, 7, 999])
def test_greedy_refuses_nan_anywhere(where: int) -> None:
    logits = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    logits[where] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        Sampler()(logits)


def test_greedy_on_float32_picks_what_float64_picks() -> None:
    """Greedy reads the float32 logits as they are: widening them keeps their order, ties included."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        logits = rng.integers(-3, 4, 5000).astype(np.float32)  # many ties at the maximum
        assert Sampler()(logits) == int(np.argmax(logits.astype(np.float64)))
    with pytest.raises(ValueError, match="empty"):
        Sampler()(np.array([], np.float32))
