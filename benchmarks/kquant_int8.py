"""Block-format matmuls: the float kernels (a `quantize_act` kernel, then codegen/formats/cpu_schedules.py's float
matmul) against the 8-bit integer kernels (codegen/cpu_int8/block32.py, codegen/cpu_int8/kquant.py), in one
run: the K-quants, and Q5_0/Q5_1 (`--types Q5_0,Q5_1`; Q5_1's float path adds the q8_1 minimum fix).

    TVM_NUM_THREADS=2 python -m benchmarks.kquant_int8 [--rounds 7] [--types Q4_K,Q6_K]
                                                       [--model ../shared/golden/fixtures/llama-dense-Q4_K_M.gguf]

* GEMV (decode) on realistic matrices (1536 x 6144 and 6144 x 1536): `cold` cycles through enough
  copies of the weight to exceed the last-level cache (every call streams its weight from DRAM, as
  a model bigger than the cache does), `hot` repeats one copy (in cache);
* GEMM (prompt, T tokens) on the same matrices, in cache; also the 4-token GEMM (one token per
  register, `kquant_gemm(..., pairs=0)`) against the default one (token pairs on 512-bit targets);
* the decode step of a compiled model (`--model`), the old artifact compiled with the K-quant
  integer kernels switched off;
* a stream-read reference from the same run (stream_read.py: 64-byte loads over 1 GiB, one part
  per thread): the cold GEMVs' weight bytes per second as a fraction of it.

Old and new are interleaved round by round (the machine is shared); medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm

from benchmarks.quant_kernels import make_raw
from benchmarks.stream_read import stream_read_gb_s
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import kquant as KQ
from ggufc.codegen.formats.cpu_schedules import qmatmul
from ggufc.codegen.formats.layout import layout_spec, repack
from ggufc.codegen.target import cpu_target, named_cpu_target
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
from ggufc.ir.act_quant import ACT_SCHEME, MIN_TYPES

SHAPES = [(1536, 6144), (6144, 1536)]
LLC_BYTES = 300 << 20  # this machine's L3: cold copies must exceed it


def _build(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


class MatrixCase:
    """One weight shape: old and new kernels over `copies` copies of the weight."""

    def __init__(self, qtype: str, n: int, k: int, t: int, target: tvm.target.Target, rng: np.random.Generator) -> None:
        self.qtype, self.n, self.k, self.t = qtype, n, k, t
        raw = make_raw(qtype, (n, k), rng)
        arrays = repack(qtype, raw, (n, k))
        self.nbytes = sum(a.nbytes for a in arrays.values())
        self.copies = max(2, -(-2 * LLC_BYTES // self.nbytes))
        fields = [f for f, _, _ in layout_spec(qtype, (n, k))]
        self.weights = [[to_tvm(arrays[f].copy()) for f in fields] for _ in range(self.copies)]
        self.x1 = to_tvm(rng.standard_normal((1, k)).astype(np.float32))
        self.xt = to_tvm(rng.standard_normal((t, k)).astype(np.float32))
        self.xq1, self.xqt = to_tvm(aligned_zeros((1, k), np.float32)), to_tvm(aligned_zeros((t, k), np.float32))
        self.y1, self.yt = to_tvm(aligned_zeros((1, n), np.float32)), to_tvm(aligned_zeros((t, n), np.float32))
        scheme = "q8_1" if qtype in MIN_TYPES else ACT_SCHEME[qtype]
        quantize1, quantize_t = (_build(Q8.quantize_act((rows, k), scheme), target) for rows in (1, t))
        float_gemv, float_gemm = _build(qmatmul(qtype, n, k, gemv=True), target), _build(
            qmatmul(qtype, n, k, gemv=False), target)
        int8_gemv, int8_gemm = _build(Q8.int8_gemv(qtype, n, k, target), target), _build(
            Q8.int8_gemm(qtype, n, k, target), target)
        # the K-quants' one-token-per-register GEMM (the 32-value formats have one GEMM form)
        tile4_gemm = _build(KQ.kquant_gemm(qtype, n, k, Q8.int8_isa(target), pairs=0), target) \
            if qtype in KQ.KQUANT_GEMV_TYPES else int8_gemm
        old_matmul = _old_matmul(qtype, n, k, target, fields)

        def old_gemv(w: list[tvm.runtime.Tensor]) -> None:
            old_matmul(quantize1, float_gemv, self.x1, self.xq1, w, self.y1)

        def old_gemm(w: list[tvm.runtime.Tensor]) -> None:
            old_matmul(quantize_t, float_gemm, self.xt, self.xqt, w, self.yt)

        self.runs: dict[str, Callable[[list[tvm.runtime.Tensor]], None]] = {
            "old_gemv": old_gemv, "new_gemv": lambda w: int8_gemv(self.x1, *w, self.y1),
            "old_gemm": old_gemm, "new_gemm": lambda w: int8_gemm(self.xt, *w, self.yt),
            "tile4_gemm": lambda w: tile4_gemm(self.xt, *w, self.yt)}
        self.has_tile4 = qtype in KQ.KQUANT_GEMV_TYPES
        self.check()
        self.times: dict[str, list[float]] = {}

    def check(self) -> None:
        """Old and new agree (the new one's float order differs: ulps)."""
        outs = {}
        for name in ("old_gemv", "new_gemv"):
            self.runs[name](self.weights[0])
            outs[name] = self.y1.numpy().copy()
        err = np.abs(outs["old_gemv"] - outs["new_gemv"]).max() / np.abs(outs["old_gemv"]).max()
        assert err < 1e-4, f"{self.qtype} {self.n}x{self.k}: old and new GEMVs differ by {err:.2e}"

    def round(self) -> None:
        for mode in ("gemv", "gemm"):
            for which in ("old", "new") if mode == "gemv" or not self.has_tile4 else ("old", "tile4", "new"):
                run = self.runs[f"{which}_{mode}"]
                if mode == "gemv":  # cold: one call per copy, every weight byte from DRAM
                    t0 = time.perf_counter()
                    for w in self.weights:
                        run(w)
                    self.times.setdefault(f"{which}_gemv_cold", []).append((time.perf_counter() - t0) / self.copies)
                reps = 20 if mode == "gemv" else 3
                run(self.weights[0])
                t0 = time.perf_counter()
                for _ in range(reps):
                    run(self.weights[0])
                self.times.setdefault(f"{which}_{mode}_hot", []).append((time.perf_counter() - t0) / reps)
                time.sleep(0.05)


def _old_matmul(qtype: str, n: int, k: int, target: tvm.target.Target,
                fields: list[str]) -> Callable[..., None]:
    """The float path of a matmul: quantize_act, the float kernel, and for the types with block
    minimums (q8_1) the kernel moving each minimum term onto the q8_1 block sums."""
    if qtype not in MIN_TYPES:
        def plain(quantize: Callable[..., None], matmul: Callable[..., None], x: tvm.runtime.Tensor,
                  xq: tvm.runtime.Tensor, w: list[tvm.runtime.Tensor], y: tvm.runtime.Tensor) -> None:
            quantize(x, xq)
            matmul(xq, *w, y)

        return plain
    min_fix = _build(Q8.q8_1_min_fix(n, k), target)
    scratch: dict[int, tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]] = {}

    def with_mins(quantize: Callable[..., None], matmul: Callable[..., None], x: tvm.runtime.Tensor,
                  xq: tvm.runtime.Tensor, w: list[tvm.runtime.Tensor], y: tvm.runtime.Tensor) -> None:
        t = x.shape[0]
        if t not in scratch:
            scratch[t] = (to_tvm(aligned_zeros((t, k // 32), np.float32)), to_tvm(aligned_zeros((t, n), np.float32)))
        sums, y0 = scratch[t]
        quantize(x, xq, sums)
        matmul(xq, *w, y0)
        min_fix(y0, xq, sums, w[fields.index("m")], y)

    return with_mins


def model_decode(model: Path, rounds: int, tokens: int, threads: int) -> dict[str, list[float]]:
    """Seconds per decode step of `model`, old (K-quant integer kernels off) and new, interleaved."""
    with tempfile.TemporaryDirectory(prefix="kquant-bench-") as tmp:
        return _decode_times(model, Path(tmp), rounds, tokens, threads)


def _decode_times(model: Path, tmp: Path, rounds: int, tokens: int, threads: int) -> dict[str, list[float]]:
    from ggufc.driver.models import compile_gguf
    from ggufc.runtime.session import Session

    kept = KQ.KQUANT_GEMV_TYPES
    KQ.KQUANT_GEMV_TYPES = frozenset()  # the old compile: K-quant matmuls on the float kernels
    try:
        compile_gguf(model, "llvm", tmp / "old", None)
    finally:
        KQ.KQUANT_GEMV_TYPES = kept
    compile_gguf(model, "llvm", tmp / "new", None)
    sessions = {name: Session(tmp / name, threads=threads) for name in ("old", "new")}
    times: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for _ in range(rounds):
            for name, s in sessions.items():
                s.reset()
                tok = int(np.argmax(s.forward(np.arange(1, 9, dtype=np.int32))))
                t0 = time.perf_counter()
                for _ in range(tokens):
                    tok = int(np.argmax(s.forward([tok])))
                times[name].append((time.perf_counter() - t0) / tokens)
                time.sleep(0.2)
    finally:
        for s in sessions.values():
            s.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--types", default="Q4_K")
    ap.add_argument("--prefill-t", type=int, default=64)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file whose decode step is timed")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--cpu", default=None, metavar="NAME", help="the kernels for this CPU (ggufc compile --cpu)")
    args = ap.parse_args()
    target = named_cpu_target(args.cpu) if args.cpu else cpu_target()
    threads = tvm.get_global_func("runtime.NumThreads")()
    isa = Q8.int8_isa(target)
    print(f"target {target.attrs['mcpu']}, 8-bit instruction set {isa.name if isa else None}, TVM threads {threads}",
          flush=True)
    rng = np.random.default_rng(0)
    cases = [MatrixCase(qt, n, k, args.prefill_t, target, rng) for qt in args.types.split(",") for n, k in SHAPES]
    stream = [stream_read_gb_s(threads, repeats=3)["read_gb_s"]]
    for _ in range(args.rounds):
        for c in cases:
            c.round()
        stream.append(stream_read_gb_s(threads, repeats=3)["read_gb_s"])
    read_gb_s = statistics.median(stream)
    print(f"stream read (stream_read.py, 1 GiB): median {read_gb_s:.1f} GB/s over {len(stream)} runs")
    print(f"{'type':5} {'N':>5} {'K':>5} {'kernel':10} | {'old ms':>8} {'new ms':>8} {'old/new':>7} |"
          f" {'old GB/s':>8} {'new GB/s':>8} | {'new/stream':>10}")
    for c in cases:
        for mode in ("gemv_cold", "gemv_hot", "gemm_hot"):
            old, new = statistics.median(c.times[f"old_{mode}"]), statistics.median(c.times[f"new_{mode}"])
            label = mode if mode != "gemm_hot" else f"gemm T={c.t}"
            bw = f"{c.nbytes / old / 1e9:8.1f} {c.nbytes / new / 1e9:8.1f} | {c.nbytes / new / 1e9 / read_gb_s:10.2f}" \
                if mode.startswith("gemv") else f"{'-':>8} {'-':>8} | {'-':>10}"
            times = f"{old * 1e3:8.3f} {new * 1e3:8.3f} {old / new:7.2f}"
            print(f"{c.qtype:5} {c.n:5d} {c.k:5d} {label:10} | {times} | {bw}")
        if not c.has_tile4:
            continue
        tile4, new = statistics.median(c.times["tile4_gemm_hot"]), statistics.median(c.times["new_gemm_hot"])
        print(f"{c.qtype:5} {c.n:5d} {c.k:5d} {'4-token':10} | {tile4 * 1e3:8.3f} {new * 1e3:8.3f} {tile4 / new:7.2f} |"
              f" (the one-token-per-register GEMM against the default one)")
    if args.model is not None:
        times = model_decode(args.model, args.rounds, args.decode_tokens, threads)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"decode step of {args.model.name}: old {old * 1e3:.3f} ms, new {new * 1e3:.3f} ms, "
              f"old/new {old / new:.2f} (medians of {args.rounds} x {args.decode_tokens} tokens)")


if __name__ == "__main__":
    main()
