"""How far batching several sequences can speed decode up while each row stays bit for bit a
one-token step: the batched step's 8-bit GEMMs timed with their weights cache-resident.

`ggufc serve` decodes the tokens of its busy slots in one call (`decode_batch`) whose rows equal
one-token steps bit for bit, so each (row, token, 32-value block) still pays the one-token
kernel's float steps (an 8-lane integer dot, its conversion, an fma; codegen/cpu_int8/pair_gemm.py):
batching shares the weight reads, not that arithmetic. With the weights already in the caches, a
GEMM's time is that arithmetic alone, so the sum over one step's GEMMs at P rows is a floor under
the batched step, and P * (one-token step) / floor bounds what batching P streams can gain.

    python -m benchmarks.batch_gemm_floor ARTIFACT [--rows 2,4,8] [--steps 40]

Every 2-D 8-bit weight of the artifact is one GEMM per step (the tied token embedding counts once,
as the output layer). The one-token step is timed on the artifact itself (Session.forward), after
a short prompt, in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tvm

from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.target import cpu_target
from ggufc.driver.tune.worker import configure_threads


def step_gemms(artifact: Path) -> Counter[tuple[str, int, int]]:
    """(qtype, n, k) -> GEMM calls per decode step, from the artifact's weights."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    calls: Counter[tuple[str, int, int]] = Counter()
    for param in manifest["params"]:
        arrays = param["arrays"]
        if param["qtype"] in Q8.PAIR_GEMM_TYPES and len(arrays[0]["shape"]) == 2:
            n, blocks = arrays[0]["shape"]
            calls[(param["qtype"], int(n), int(blocks) * 32)] += 1
    return calls


def hot_time(qtype: str, n: int, k: int, rows: int, target: tvm.target.Target, reps: int = 200) -> float:
    """Seconds per call of the batched decode's GEMM for `rows` rows, weights cache-resident."""
    func = Q8.int8_gemm(qtype, n, k, target)
    fn = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target).mod["main"]
    rng = np.random.default_rng(0)
    weights = []
    for _, shape, dtype in layout_spec(qtype, (n, k)):
        values = rng.integers(0, 256, shape).astype(dtype) if dtype != "float16" else (
            rng.random(shape).astype(np.float16) * np.float16(1e-2))
        weights.append(tvm.runtime.tensor(np.ascontiguousarray(values)))
    x = tvm.runtime.tensor(rng.standard_normal((rows, k)).astype(np.float32))
    y = tvm.runtime.tensor(np.zeros((rows, n), np.float32))
    fn(x, *weights, y)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x, *weights, y)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def one_token_step(artifact: Path, steps: int) -> float:
    """Median seconds of a one-token decode step on the artifact, after an 8-token prompt."""
    from ggufc.runtime.session import Session

    session = Session(artifact)
    try:
        session.forward(list(range(100, 108)))
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            session.forward([200 + i])
            times.append(time.perf_counter() - t0)
        return float(np.median(times))
    finally:
        session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--rows", default="2,4,8", help="batched rows to time (default 2,4,8)")
    ap.add_argument("--steps", type=int, default=40, help="one-token steps timed (default 40)")
    args = ap.parse_args()
    configure_threads()
    target = cpu_target()
    calls = step_gemms(args.artifact)
    if not calls:
        raise SystemExit(f"{args.artifact}: no Q4_0/Q4_1/Q8_0 weights (the batched GEMMs timed here)")
    single = one_token_step(args.artifact, args.steps)
    print(f"{args.artifact}: one-token decode step {single * 1e3:.2f} ms (median of {args.steps})")
    print("rows  GEMMs per step, hot   per row   rows x one-token step / hot GEMMs (bound on the batching gain)")
    for rows in (int(r) for r in args.rows.split(",")):
        floor = sum(count * hot_time(q, n, k, rows, target) for (q, n, k), count in calls.items())
        print(f"{rows:4d}  {floor * 1e3:8.2f} ms          {floor / rows * 1e3:6.2f} ms  {rows * single / floor:6.2f}x")


if __name__ == "__main__":
    main()
