"""Decode GEMVs built for another x86 CPU: the 8-bit integer kernel against the float kernel it
replaces (codegen/qmatmul, which dequantizes the weights as it goes), both for one target.

    python -m benchmarks.int8_isa_gemv [--cpu haswell] [--types Q4_0,Q8_0,Q4_K,Q6_K] [--rounds 3]

The default target is haswell (AVX2 + FMA, the 8-bit kernels' AVX2 form: vpmaddubsw + vpmaddwd),
which runs on any x86 CPU with AVX-512 too, so the AVX2 kernels can be timed on such a machine.
The float kernel's time leaves out the separate quantize_act kernel it needs before it (the 8-bit
kernel rounds its input itself), so the ratio slightly favours the float kernel. Rounds are
interleaved and the best time of each kept (a shared machine varies by +-30 %).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tvm

from benchmarks.quant_kernels import make_raw, tvm_timer
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8.isa import int8_isa
from ggufc.codegen.formats.cpu_schedules import qmatmul
from ggufc.codegen.formats.layout import layout_spec, repack
from ggufc.codegen.tvm_util import aligned_copy, aligned_zeros, to_tvm

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632)]  # a 1.1B llama's q/o, gate/up, down


def _time_pair(qtype: str, n: int, k: int, target: tvm.target.Target, rounds: int) -> tuple[float, float, int]:
    """(int8 seconds, float seconds, weight bytes) of one GEMV, outputs checked against each other."""
    rng = np.random.default_rng(n + k)
    arrays = repack(qtype, make_raw(qtype, (n, k), rng), (n, k))
    fields = [to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, k))]
    x = aligned_copy(rng.standard_normal((1, k)).astype(np.float32))
    y8, yf = aligned_zeros((1, n), np.float32), aligned_zeros((1, n), np.float32)
    mod8 = tvm.compile(tvm.IRModule({"main": Q8.int8_gemv(qtype, n, k, target).with_attr("global_symbol", "main")}),
                       target=target)
    modf = tvm.compile(qmatmul(qtype, n, k, gemv=True), target=target)
    acts = aligned_copy(Q8_rounded(x, qtype))
    mod8(to_tvm(x), *fields, to_tvm(y8))
    modf(to_tvm(acts), *(to_tvm(a) for a in arrays.values()), to_tvm(yf))
    np.testing.assert_allclose(y8, yf, rtol=1e-3, atol=1e-3 * float(np.abs(yf).max()))
    t8 = tvm_timer(mod8.mod, [to_tvm(x), *fields, to_tvm(y8)], 50)
    tf = tvm_timer(modf.mod, [to_tvm(acts), *(to_tvm(a) for a in arrays.values()), to_tvm(yf)], 50)
    best8 = bestf = float("inf")
    for _ in range(rounds):
        best8 = min(best8, t8())
        time.sleep(0.1)
        bestf = min(bestf, tf())
        time.sleep(0.1)
    return best8, bestf, sum(a.nbytes for a in arrays.values())


def Q8_rounded(x: np.ndarray, qtype: str) -> np.ndarray:  # noqa: N802 - named after the scheme
    """The float kernel's input: x rounded as the 8-bit kernel rounds it."""
    from ggufc.ir.act_quant import ACT_SCHEME, quantize_act_ref

    return quantize_act_ref(x, ACT_SCHEME[qtype]).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", default="haswell", help="LLVM CPU name to build for (it must run here)")
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    target = tvm.target.Target({"kind": "llvm", "mcpu": args.cpu, "num-cores": 2})
    isa = int8_isa(target)
    if isa is None:
        raise SystemExit(f"error: {args.cpu} has no AVX2 + FMA: no 8-bit kernels to time")
    threads = tvm.get_global_func("runtime.NumThreads")()
    print(f"built for {args.cpu} (8-bit instruction set {isa.name}), TVM threads {threads}")
    print(f"{'type':6} {'n x k':>12} {'int8 us':>9} {'float us':>9} {'int8 GB/s':>9} {'speedup':>8}")
    for qtype in args.types.split(","):
        for n, k in SHAPES:
            t8, tf, nbytes = _time_pair(qtype, n, k, target, args.rounds)
            shape = f"{n}x{k}"
            print(f"{qtype:6} {shape:>12} {t8 * 1e6:9.1f} {tf * 1e6:9.1f} {nbytes / t8 / 1e9:9.1f} {tf / t8:7.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
