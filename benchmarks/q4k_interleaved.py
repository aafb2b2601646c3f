"""Q4_K: the 8-row interleaved kernels (codegen/cpu_int8/q4k_interleaved.py) against the row-major
ones (codegen/cpu_int8/kquant.py), both in llama.cpp's repacked order, in one run.

    TVM_NUM_THREADS=2 python -m benchmarks.q4k_interleaved [--rounds 7] [--prefill-t 64] [--cpu NAME]

On TinyLlama-1.1B's matrix shapes (2048 x 2048, 5632 x 2048, 2048 x 5632), built for haswell
(AVX2) or `--cpu NAME` (native: this machine; any CPU whose 8-bit kernels repack Q4_K, as
AVX-512 VNNI without AMX, where the prompt GEMM takes two row groups per register):

* decode GEMV (one token): `hot` repeats one copy of the weight (in cache), `cold` cycles through
  enough copies to exceed the last-level cache (every call streams its weight from DRAM);
* prompt GEMM of T tokens (in cache).

Both kernels' outputs are checked equal bit for bit first (the same float order). Old and new
are interleaved round by round (the machine is shared); medians and bests are reported, old/new > 1
means the interleaved kernel is faster. `--shapes 1536x1536,6144x1536` times other matrices.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import tvm

from benchmarks.quant_kernels import make_raw
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.cpu_int8.isa import int8_isa
from ggufc.codegen.formats.layout import layout_spec, repack
from ggufc.codegen.target import named_cpu_target
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632)]
LLC_BYTES = 300 << 20  # this machine's L3: cold copies must exceed it

Weights = list[tvm.runtime.Tensor]


def _build(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


class ShapeCase:
    """One weight shape in both layouts, `copies` copies of each for the cold GEMV."""

    def __init__(self, n: int, k: int, t: int, cold: bool, rng: np.random.Generator,
                 target: tvm.target.Target) -> None:
        isa = int8_isa(target)
        if isa is None or not X.eligible("Q4_K", (n, k), target):
            raise SystemExit(f"{target.attrs['mcpu']}: Q4_K {n} x {k} is not stored interleaved there")
        self.n, self.k, self.t = n, k, t
        raw = make_raw("Q4_K", (n, k), rng)
        rows = repack("Q4_K", raw, (n, k))
        inter = X.interleave(rows, (n, k))
        nbytes = sum(a.nbytes for a in rows.values())
        self.copies = max(2, -(-2 * LLC_BYTES // nbytes)) if cold else 1
        self.weights: dict[str, list[Weights]] = {
            "old": [[to_tvm(rows[f].copy()) for f, _, _ in layout_spec("Q4_K", (n, k))] for _ in range(self.copies)],
            "new": [[to_tvm(inter[f].copy()) for f, _, _ in X.layout_spec((n, k))] for _ in range(self.copies)]}
        self.x1 = to_tvm(rng.standard_normal((1, k)).astype(np.float32))
        self.xt = to_tvm(rng.standard_normal((t, k)).astype(np.float32))
        self.y1, self.yt = to_tvm(aligned_zeros((1, n), np.float32)), to_tvm(aligned_zeros((t, n), np.float32))
        gemv = {"old": _build(Q8.int8_gemv("Q4_K", n, k, target), target),
                "new": _build(X.x8_gemv_group((n,), k, isa, (), False), target)}
        gemm = {"old": _build(Q8.int8_gemm("Q4_K", n, k, target), target),
                "new": _build(X.x8_gemm(n, k, isa), target)}
        self.runs: dict[str, Callable[[Weights], None]] = {}
        for which in ("old", "new"):
            self.runs[f"{which}_gemv"] = lambda w, f=gemv[which]: f(self.x1, *w, self.y1)
            self.runs[f"{which}_gemm"] = lambda w, f=gemm[which]: f(self.xt, *w, self.yt)
        self.check()
        self.times: dict[str, list[float]] = {}

    def check(self) -> None:
        for mode, y in (("gemv", self.y1), ("gemm", self.yt)):
            outs = []
            for which in ("old", "new"):
                self.runs[f"{which}_{mode}"](self.weights[which][0])
                outs.append(y.numpy().copy())
            assert np.array_equal(outs[0], outs[1]), f"{self.n}x{self.k} {mode}: old and new differ"

    def round(self, cold: bool) -> None:
        for mode, reps in (("gemv", 20), ("gemm", 3)):
            for which in ("old", "new"):
                run, weights = self.runs[f"{which}_{mode}"], self.weights[which]
                if mode == "gemv" and cold:
                    t0 = time.perf_counter()
                    for w in weights:
                        run(w)
                    self.times.setdefault(f"{which}_gemv_cold", []).append((time.perf_counter() - t0) / len(weights))
                run(weights[0])
                t0 = time.perf_counter()
                for _ in range(reps):
                    run(weights[0])
                self.times.setdefault(f"{which}_{mode}_hot", []).append((time.perf_counter() - t0) / reps)
                time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefill-t", type=int, default=64)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold GEMVs (their copies take ~1.2 GB)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K of each matrix")
    ap.add_argument("--cpu", default="haswell", help="the CPU to build for, by LLVM name (native: this one)")
    args = ap.parse_args()
    target = named_cpu_target(args.cpu, 2)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    threads = tvm.get_global_func("runtime.NumThreads")()
    isa = int8_isa(target)
    print(f"target {target.attrs['mcpu']} ({isa.name if isa else None}), TVM threads {threads}, {args.rounds} rounds",
          flush=True)
    rng = np.random.default_rng(0)
    print(f"{'N':>5} {'K':>5} {'kernel':12} | {'old ms':>8} {'new ms':>8} {'old/new':>7} | best: {'old ms':>8} "
          f"{'new ms':>8} {'old/new':>7}")
    for n, k in shapes:  # one shape at a time: the cold copies of all three would not fit beside each other
        case = ShapeCase(n, k, args.prefill_t, not args.no_cold, rng, target)
        for _ in range(args.rounds):
            case.round(not args.no_cold)
        modes = ["gemv_hot", "gemm_hot"] if args.no_cold else ["gemv_cold", "gemv_hot", "gemm_hot"]
        for mode in modes:
            old, new = statistics.median(case.times[f"old_{mode}"]), statistics.median(case.times[f"new_{mode}"])
            old_best, new_best = min(case.times[f"old_{mode}"]), min(case.times[f"new_{mode}"])
            label = f"gemm T={case.t}" if mode == "gemm_hot" else mode
            print(f"{n:5d} {k:5d} {label:12} | {old * 1e3:8.3f} {new * 1e3:8.3f} {old / new:7.2f} | "
                  f"      {old_best * 1e3:8.3f} {new_best * 1e3:8.3f} {old_best / new_best:7.2f}", flush=True)
        del case


if __name__ == "__main__":
    main()
