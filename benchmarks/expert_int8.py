"""Routed experts' matmuls: the float kernels (a `quantize_act` q8_K kernel, then codegen/formats/cpu_schedules.py's
`qmatmul_experts`) against the 8-bit integer kernel (codegen/cpu_int8/experts.py), in one run.

    TVM_NUM_THREADS=2 python -m benchmarks.expert_int8 [--rounds 7] [--tokens 1,128]

Shapes of the MoE benchmark model (make_bench_model.py moe: 32 experts, 4 used, n_embd 1024,
expert FFN 768): gate/up [32, 768, 1024] Q4_K reading one row per token, down [32, 1024, 768]
(Q4_K and Q6_K) reading a row per slot. One token is a decode step's call, 128 a prompt's
(random routing, distinct experts per token). Every call's weights are one of enough copies to
exceed the last-level cache (a decode step streams its experts from DRAM). Old and new are
interleaved round by round (the machine is shared); medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import tvm

from benchmarks.quant_kernels import make_raw
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import experts as E8
from ggufc.codegen.formats.cpu_schedules import qmatmul_experts
from ggufc.codegen.formats.layout import layout_spec, repack
from ggufc.codegen.target import cpu_target
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm

N_EXP, SLOTS = 32, 4
CASES = [("gate/up", "Q4_K", 768, 1024, False), ("down", "Q4_K", 1024, 768, True), ("down", "Q6_K", 1024, 768, True)]
LLC_BYTES = 300 << 20


def _build(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def _case(kind: str, qtype: str, n: int, k: int, per_slot: bool, tokens: int, rounds: int,
          target: tvm.target.Target, rng: np.random.Generator) -> dict[str, float]:
    raw = make_raw(qtype, (N_EXP * n, k), rng)
    arrays = repack(qtype, raw, (N_EXP * n, k))
    spec = layout_spec(qtype, (N_EXP, n, k))
    nbytes = sum(a.nbytes for a in arrays.values())
    copies = max(2, -(-2 * LLC_BYTES // nbytes))
    weights = [[to_tvm(np.ascontiguousarray(arrays[f].reshape(s)).copy()) for f, s, _ in spec] for _ in range(copies)]
    sx = SLOTS if per_slot else 1
    x = to_tvm(rng.standard_normal((tokens, sx, k)).astype(np.float32))
    xq = to_tvm(aligned_zeros((tokens, sx, k), np.float32))
    ids = to_tvm(np.stack([rng.choice(N_EXP, SLOTS, replace=False) for _ in range(tokens)]).astype(np.int32))
    y_old, y_new = (to_tvm(aligned_zeros((tokens, SLOTS, n), np.float32)) for _ in range(2))
    shape = (tvm.tirx.IntImm("int64", tokens), tvm.tirx.IntImm("int64", sx), tvm.tirx.IntImm("int64", k))
    rounding = _build(Q8.quantize_act(shape, "q8_K"), target)
    old = _build(qmatmul_experts(qtype, N_EXP, n, k, SLOTS, x_per_slot=per_slot), target)
    new = _build(E8.int8_experts(qtype, N_EXP, n, k, SLOTS, per_slot, target), target)

    def run_old(w: list[tvm.runtime.Tensor]) -> None:
        rounding(x, xq)
        old(xq, ids, *w, y_old)

    def run_new(w: list[tvm.runtime.Tensor]) -> None:
        new(x, ids, *w, y_new)

    times: dict[str, list[float]] = {"old": [], "new": []}
    calls = copies if tokens == 1 else 2
    for r in range(rounds):
        order = [("old", run_old), ("new", run_new)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            for c in range(calls):
                fn(weights[c % copies])
            times[name].append((time.perf_counter() - t0) / calls)
    diff = float(np.abs(y_old.numpy() - y_new.numpy()).max() / np.abs(y_old.numpy()).max())
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{kind:8s} {qtype} [{N_EXP}, {n}, {k}] T={tokens:<4d} float {old_s * 1e3:8.3f} ms"
          f"  int8 {new_s * 1e3:8.3f} ms  speedup {old_s / new_s:5.2f}x  (max rel diff {diff:.1e})", flush=True)
    return {"old_s": old_s, "new_s": new_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", default="1,128")
    args = ap.parse_args()
    target = cpu_target()
    if Q8.int8_isa(target) is None:
        sys.exit(f"error: {target.attrs.get('mcpu')} has no 8-bit dot product; nothing to compare")
    rng = np.random.default_rng(0)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for kind, qtype, n, k, per_slot in CASES:
            _case(kind, qtype, n, k, per_slot, tokens, args.rounds, target, rng)


if __name__ == "__main__":
    main()
