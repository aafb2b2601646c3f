"""Quantised matmul kernels (codegen/formats/cpu_schedules.py) against numpy on pre-dequantised f32 weights.

    python -m benchmarks.quant_kernels [--types Q4_1,Q8_0] [--rounds 3] [--prefill-t 64]

Shapes are SmolLM2-135M's (hidden 576, ffn 1536, vocab 49152). For each case one row: kernel time,
GB/s of weight bytes read (kernel layout, = GGUF size +0-3 %), GFLOP/s, numpy time and the ratio
numpy/TVM (>1: TVM faster). gemv is T=1 (decode); prefill is T tokens against one weight matrix.
numpy uses f32 weights (4-8x the bytes) and its BLAS (sgemv/sgemm). Rounds are interleaved and the
best time of each kept: on a shared VM single timings vary by +-30 % (and far more while other jobs
run). The two libraries are timed in separate blocks because both thread pools spin-wait after
each call. TVM's runtime uses hardware_concurrency/2 threads on x86 unless TVM_NUM_THREADS is set
(1 thread on a 2-vCPU VM); numpy's BLAS uses all CPUs unless OPENBLAS_NUM_THREADS is set.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import tvm

from ggufc.codegen.formats.cpu_schedules import CpuTiles, qmatmul
from ggufc.codegen.formats.layout import dequantize_reference, repack
from ggufc.codegen.formats.table import get_format
from ggufc.codegen.target import cpu_target
from ggufc.codegen.tvm_util import aligned_copy, aligned_zeros, to_tvm

GEMV_SHAPES = [(1536, 576), (576, 1536), (576, 576)]
OUTPUT_SHAPE = (49152, 576)  # tied embedding / output layer, benchmarked for Q8_0


@dataclass
class Case:
    qtype: str
    mode: str  # "gemv" | "prefill"
    n: int
    k: int
    t: int
    weight_bytes: int
    run_tvm: Callable[[], float]
    run_numpy: Callable[[], float]
    best_tvm: float = float("inf")
    best_numpy: float = float("inf")


def make_raw(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    qt = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(values, qt)
    except NotImplementedError:  # K-quants: random blocks with sane f16 scales
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, type_size), dtype=np.uint8)
        d = rng.uniform(1e-3, 1e-2, size=raw.shape[:-1]).astype(np.float16).view(np.uint8)
        for at in {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}.get(qtype, (0, 2)):  # f16 d (and dmin)
            raw[..., at:at + 2] = d.reshape(*raw.shape[:-1], 2)
        return raw.reshape(shape[0], -1)


def tvm_timer(fn: tvm.runtime.Module, args: list[tvm.runtime.Tensor], min_ms: int) -> Callable[[], float]:
    ev = fn.time_evaluator("main", tvm.cpu(), number=1, repeat=5, min_repeat_ms=int(min_ms))
    return lambda: float(min(ev(*args).results))


def numpy_timer(x: np.ndarray, w: np.ndarray, min_ms: float) -> Callable[[], float]:
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    wt = w.T

    def run() -> float:
        best = float("inf")
        for _ in range(5):
            reps, start = 0, time.perf_counter()
            while True:
                np.matmul(x, wt, out=y)
                reps += 1
                elapsed = time.perf_counter() - start
                if elapsed * 1e3 >= min_ms:
                    break
            best = min(best, elapsed / reps)
        return best

    return run


def build_case(qtype: str, mode: str, n: int, k: int, t: int, target: tvm.target.Target,
               rng: np.random.Generator) -> Case:
    raw = make_raw(qtype, (n, k), rng)
    arrays = repack(qtype, raw, (n, k))
    w = aligned_copy(dequantize_reference(qtype, arrays, (n, k)))
    x = aligned_copy(rng.standard_normal((t, k)).astype(np.float32))
    func = qmatmul(qtype, n, k, gemv=mode == "gemv")
    ex = tvm.compile(func, target=target)
    y = aligned_zeros((t, n), np.float32)
    args = [to_tvm(x), *(to_tvm(a) for a in arrays.values()), to_tvm(y)]
    ex(*args)
    time.sleep(0.2)  # let TVM's workers sleep before numpy's BLAS runs
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-3, atol=1e-3 * float(np.abs(x @ w.T).max()))
    nbytes = sum(a.nbytes for a in arrays.values())
    return Case(qtype, mode, n, k, t, nbytes, tvm_timer(ex.mod, args, 20), numpy_timer(x, w, 20.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_1,Q8_0", help="comma-separated GGUF types")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-t", type=int, default=64)
    args = ap.parse_args()
    target = cpu_target()
    rng = np.random.default_rng(0)
    num_threads = tvm.get_global_func("runtime.NumThreads")()
    print(f"target {target.attrs['mcpu']}, TVM runtime threads {num_threads}, "
          f"tiles {CpuTiles.for_target(target)}", flush=True)
    cases: list[Case] = []
    for qtype in args.types.split(","):
        shapes = GEMV_SHAPES + ([OUTPUT_SHAPE] if qtype == "Q8_0" else [])
        if get_format(qtype).block == 256:
            shapes = [(n, k) for n, k in shapes if k % 256 == 0] or [(1536, 512), (512, 1536)]
        for n, k in shapes:
            cases.append(build_case(qtype, "gemv", n, k, 1, target, rng))
        for n, k in shapes[:3]:
            cases.append(build_case(qtype, "prefill", n, k, args.prefill_t, target, rng))
    for _ in range(args.rounds):  # interleave rounds: noise hits every case alike
        # TVM's and OpenBLAS's workers both spin-wait after a call: time each library in its own
        # block and let the other's threads fall asleep first, or they fight for the cores
        for c in cases:
            c.best_tvm = min(c.best_tvm, c.run_tvm())
        time.sleep(0.5)
        for c in cases:
            c.best_numpy = min(c.best_numpy, c.run_numpy())
        time.sleep(0.5)
    print(f"{'type':5} {'kernel':8} {'N':>6} {'K':>5} {'T':>3} | {'TVM ms':>8} {'GB/s':>6} {'GFLOP/s':>8} |"
          f" {'numpy ms':>9} {'GFLOP/s':>8} | {'numpy/TVM':>9} | {'T*gemv/prefill':>14}")
    gemv_time = {(c.qtype, c.n, c.k): c.best_tvm for c in cases if c.mode == "gemv"}
    for c in cases:
        flops = 2.0 * c.t * c.n * c.k
        tt, tn = c.best_tvm, c.best_numpy
        # prefill is compute-bound: bytes/s of weights says nothing there
        gbs = f"{c.weight_bytes / tt / 1e9:6.1f}" if c.mode == "gemv" else f"{'-':>6}"
        print(f"{c.qtype:5} {c.mode:8} {c.n:6d} {c.k:5d} {c.t:3d} | {tt * 1e3:8.3f} {gbs} "
              f"{flops / tt / 1e9:8.1f} | {tn * 1e3:9.3f} {flops / tn / 1e9:8.1f} | {tn / tt:9.2f} | "
              + (f"{c.t * gemv_time[c.qtype, c.n, c.k] / tt:14.2f}" if c.mode == "prefill" else ""))


if __name__ == "__main__":
    main()
