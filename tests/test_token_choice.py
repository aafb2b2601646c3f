"""The token choice of OpenAI's options on synthetic logits: logit_bias, presence / frequency
penalties over the generated tokens' counts, and the model's log-probabilities."""

from __future__ import annotations

import numpy as np

from ggufc.runtime.sampling import Sampler
from ggufc.runtime.token_choice import Decoding, TokenChooser, token_logprob

LOGITS = np.array([1.0, 3.0, 2.9, 0.5, -1.0], np.float32)


def test_plain_greedy_is_the_argmax_and_logprobs_are_the_raw_log_softmax() -> None:
    chooser = TokenChooser(Sampler(), Decoding(top_logprobs=2))
    token, logprob = chooser.choose(LOGITS)
    expected = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert token == 1 and logprob is not None
    assert abs(logprob.logprob - expected[1]) < 1e-12
    assert [t for t, _ in logprob.top] == [1, 2]
    assert np.allclose([lp for _, lp in logprob.top], expected[[1, 2]], rtol=0, atol=1e-12)


def test_logit_bias_is_added_to_the_logits() -> None:
    chooser = TokenChooser(Sampler(), Decoding(logit_bias={1: -100.0, 4: 3.5}))
    assert chooser.choose(LOGITS)[0] == 2  # 1 pushed down; 4 rises to 2.5, below 2.9
    chooser = TokenChooser(Sampler(), Decoding(logit_bias={4: 4.5}))
    assert chooser.choose(LOGITS)[0] == 4


def test_penalties_follow_the_generated_counts() -> None:
    logits = np.array([1.0, 3.0, 2.5, 0.5, -1.0], np.float32)  # sums exact in binary
    chooser = TokenChooser(Sampler(), Decoding(presence_penalty=0.125, frequency_penalty=0.25))
    picks = [chooser.choose(logits)[0] for _ in range(4)]
    # 1 once: 3 - 0.375 = 2.625 > 2.5; twice: 2.375 < 2.5, so 2; then 2 at 2.125 < 2.375, so 1
    assert picks == [1, 1, 2, 1]
    scores = chooser.scores(logits)
    assert scores.tolist() == [1.0, 3.0 - 0.125 - 3 * 0.25, 2.5 - 0.125 - 0.25, 0.5, -1.0]


def test_logprobs_stay_the_model_s_under_steering() -> None:
    chooser = TokenChooser(Sampler(), Decoding(logit_bias={4: 10.0}, top_logprobs=0))
    token, logprob = chooser.choose(LOGITS)
    assert token == 4 and logprob is not None
    assert logprob.logprob == token_logprob(LOGITS, 4, 0).logprob < -4


def test_seeded_choices_repeat() -> None:
    def run() -> list[int]:
        chooser = TokenChooser(Sampler(temperature=1.0, seed=7), Decoding(frequency_penalty=0.5))
        return [chooser.choose(LOGITS)[0] for _ in range(20)]

    assert run() == run()
