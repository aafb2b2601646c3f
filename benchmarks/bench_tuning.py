"""A model's decode step with default schedules vs with a `ggufc tune` database, side by side.

With `--tune-minutes M`, first runs a `ggufc tune` session of that budget into DIR (MetaSchedule
and the hand-written kernels' knobs; `--only KIND` restricts it). Then compiles the model twice
(without and with `--tuning-db DIR`), times decode steps of both artifacts in alternating rounds
(so machine load hits both alike) and reports the best and median milliseconds per step, the
ratio, which kernels the database replaced (with their knob settings), and whether the two
artifacts' logits are bit-identical (they are when only knob settings were applied).

    python benchmarks/bench_tuning.py --db DIR [MODEL.gguf] [--tune-minutes 30] [--tokens 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import numpy as np  # noqa: E402

from ggufc.driver.compile import compile_model  # noqa: E402
from ggufc.driver.models import default_model  # noqa: E402
from ggufc.driver.tune import TuneOptions, tune_model  # noqa: E402
from ggufc.runtime.session import Session  # noqa: E402


def decode_seconds(session: Session, prompt: np.ndarray, tokens: int) -> float:
    """Seconds per decode step over `tokens` greedy steps after a short prompt."""
    session.reset()
    token = int(np.argmax(session.forward(prompt)))
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(np.argmax(session.forward(np.array([token], dtype=np.int32))))
    return (time.perf_counter() - t0) / tokens


def same_logits(a: Session, b: Session, prompt: np.ndarray, steps: int = 4) -> bool:
    """Whether both artifacts give bit-identical logits for the prompt and a few decode steps."""
    a.reset()
    b.reset()
    la, lb = a.forward(prompt), b.forward(prompt)
    same = bool(np.array_equal(la, lb))
    for _ in range(steps):
        token = np.array([int(np.argmax(la))], dtype=np.int32)
        la, lb = a.forward(token), b.forward(token)
        same = same and bool(np.array_equal(la, lb))
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--db", required=True, help="ggufc tune database")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-speedup", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="keep the two artifacts here (default: a temporary directory)")
    ap.add_argument("--tune-minutes", type=float, default=None, help="first tune into --db for this long")
    ap.add_argument("--trials-per-round", type=int, default=16)
    ap.add_argument("--only", action="append", default=None, metavar="KIND", help="with --tune-minutes")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_model()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-tuning-"))
    if args.tune_minutes:
        summary = tune_model(model, "llvm", args.db, time_budget_s=60.0 * args.tune_minutes, kinds=args.only,
                             options=TuneOptions.for_round(args.trials_per_round))
        print(summary.format())
    t0 = time.perf_counter()
    compile_model(model, "llvm", root / "default")
    t1 = time.perf_counter()
    tuned = compile_model(model, "llvm", root / "tuned", tuning_db=args.db, tuning_min_speedup=args.min_speedup)
    t2 = time.perf_counter()
    print(f"compile: default {t1 - t0:.1f} s, with database {t2 - t1:.1f} s")
    for name, info in tuned["tuning"]["kernels"].items():
        knobs = f", knobs {info['knobs']}" if info.get("knobs") else ""
        print(f"  tuned {name}: {info['label']}  {info['default_us']:.1f} -> {info['tuned_us']:.1f} us "
              f"({info['speedup']:.2f}x, {info['trials']} trials{knobs})")
    prompt = np.random.default_rng(0).integers(0, tuned["n_vocab"], size=8).astype(np.int32)
    times: dict[str, list[float]] = {"default": [], "tuned": []}
    with Session(root / "default") as a, Session(root / "tuned") as b:
        decode_seconds(a, prompt, 4)  # warm-up
        decode_seconds(b, prompt, 4)
        for _ in range(args.rounds):
            times["default"].append(decode_seconds(a, prompt, args.tokens))
            times["tuned"].append(decode_seconds(b, prompt, args.tokens))
        identical = same_logits(a, b, prompt)
    rows = {k: {"best_ms": 1e3 * min(v), "median_ms": 1e3 * float(np.median(v))} for k, v in times.items()}
    for k, r in rows.items():
        print(f"{k:<8} decode step: best {r['best_ms']:.2f} ms, median {r['median_ms']:.2f} ms")
    speed = rows["default"]["median_ms"] / rows["tuned"]["median_ms"]
    print(f"tuned vs default (median): {speed:.3f}x; logits bit-identical: {identical}")
    print(json.dumps({"model": model.name, "tuned_kernels": len(tuned["tuning"]["kernels"]), **rows,
                      "speedup_median": speed, "logits_identical": identical}))


if __name__ == "__main__":
    main()
