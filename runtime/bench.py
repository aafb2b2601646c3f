"""Prefill and decode throughput of a loaded session (best of N), as llama-bench reports them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .session import Session


@dataclass(frozen=True)
class BenchResult:
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: float
    decode_tok_s: float


def bench_session(session: Session, *, prompt_tokens: int = 64, gen_tokens: int = 32, repeats: int = 3,
                  seed: int = 0) -> BenchResult:
    """Prefill a random prompt, then decode greedily; the best of `repeats` runs of each phase."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, session.n_vocab, size=prompt_tokens).astype(np.int32)
    prefill_best = decode_best = float("inf")
    for _ in range(repeats):
        session.reset()
        t0 = time.perf_counter()
        logits = session.forward(prompt)
        prefill_best = min(prefill_best, time.perf_counter() - t0)
        token = int(np.argmax(logits))
        t1 = time.perf_counter()
        for _ in range(gen_tokens):
            token = int(np.argmax(session.forward(np.array([token], dtype=np.int32))))
        decode_best = min(decode_best, time.perf_counter() - t1)
    session.reset()
    return BenchResult(prompt_tokens, gen_tokens, prompt_tokens / prefill_best, gen_tokens / decode_best)
