"""Prompt (prefill) speed of two compiled artifacts of one model, interleaved in one run.

    python benchmarks/prefill_ab.py OLD_ARTIFACT NEW_ARTIFACT [--tokens 128] [--rounds 5] [--threads 2]

Both artifacts are loaded side by side and prefill the same prompt in turn, round by round (the
machine is shared: interleaving keeps the ratio honest where absolute figures move); medians and
bests are printed, with the largest logit difference between the two.
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
    args = ap.parse_args()
    prompt = (np.arange(args.tokens, dtype=np.int32) * 37 + 11) % 40000 + 100
    sessions = {"old": Session(args.old, threads=args.threads), "new": Session(args.new, threads=args.threads)}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    logits: dict[str, np.ndarray] = {}
    try:
        for _ in range(args.rounds):
            for name, s in sessions.items():
                s.reset()
                t0 = time.perf_counter()
                logits[name] = np.asarray(s.forward(prompt))
                times[name].append(time.perf_counter() - t0)
                time.sleep(0.2)
    finally:
        for s in sessions.values():
            s.close()
    for name, ts in times.items():
        print(f"{name}: median {args.tokens / statistics.median(ts):.1f} tok/s, best {args.tokens / min(ts):.1f}"
              f" ({', '.join(f'{t:.2f}' for t in ts)} s)")
    median_ratio = statistics.median(times["old"]) / statistics.median(times["new"])
    print(f"new/old: median {median_ratio:.2f}x, best {min(times['old']) / min(times['new']):.2f}x; "
          f"largest logit difference {float(np.abs(logits['old'] - logits['new']).max()):.3g}")


if __name__ == "__main__":
    main()
