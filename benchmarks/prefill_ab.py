"""Prompt (prefill) speed of two compiled artifacts of one model, interleaved in one run.

    python -m benchmarks.prefill_ab OLD_ARTIFACT NEW_ARTIFACT [--tokens 128] [--rounds 5] [--threads 2]
        [--decode N]

Both artifacts are loaded side by side and prefill the same prompt in turn, round by round (the
machine is shared: interleaving keeps the ratio honest where absolute figures move); medians and
bests are printed, with the largest logit difference between the two. --decode N also times N
greedy one-token steps after each prompt (decode speed at that context), compared the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from ggufc.runtime.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=0, help="greedy one-token steps timed after each prompt")
    args = ap.parse_args()
    prompt = (np.arange(args.tokens, dtype=np.int32) * 37 + 11) % 40000 + 100
    sessions = {"old": Session(args.old, threads=args.threads), "new": Session(args.new, threads=args.threads)}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    step_times: dict[str, list[float]] = {name: [] for name in sessions}
    logits: dict[str, np.ndarray] = {}
    try:
        for _ in range(args.rounds):
            for name, s in sessions.items():
                s.reset()
                t0 = time.perf_counter()
                logits[name] = np.asarray(s.forward(prompt))
                times[name].append(time.perf_counter() - t0)
                if args.decode:
                    step_times[name].append(greedy_steps(s, logits[name], args.decode) / args.decode)
                time.sleep(0.2)
    finally:
        for s in sessions.values():
            s.close()
    report("prefill", args.tokens, times)
    if args.decode:
        report(f"decode ({args.decode} steps)", 1, step_times)
    print(f"largest logit difference {float(np.abs(logits['old'] - logits['new']).max()):.3g}")


def greedy_steps(session: Session, logits: np.ndarray, steps: int) -> float:
    """Seconds for `steps` one-token forwards, each fed the previous step's argmax."""
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(logits[-1] if logits.ndim > 1 else logits))
        logits = np.asarray(session.forward(np.array([token], dtype=np.int32)))
    return time.perf_counter() - t0


def report(what: str, tokens: int, times: dict[str, list[float]]) -> None:
    for name, ts in times.items():
        print(f"{what} {name}: median {tokens / statistics.median(ts):.1f} tok/s, best {tokens / min(ts):.1f}"
              f" ({', '.join(f'{t:.4f}' for t in ts)} s)")
    median_ratio = statistics.median(times["old"]) / statistics.median(times["new"])
    print(f"{what} new/old: median {median_ratio:.3f}x, best {min(times['old']) / min(times['new']):.3f}x")


if __name__ == "__main__":
    main()
