"""The machine's read bandwidth as a decode kernel sees it: a TVM-built kernel, one task per thread,
each streaming its half of a 1 GiB buffer in 64-byte (AVX-512) loads into xor accumulators, with
and without software prefetch. Every byte is read once per call and nothing is written, so the
best time over a few calls is the stream-read roofline of a memory-bound decode step.

    python -m benchmarks.stream_read [--threads 2] [--mib 1024]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

LANES = 16  # int32 lanes of one AVX-512 load
UNROLL = 4  # independent accumulators per task (loads in flight)
PREFETCH_AHEAD = 1024  # bytes ahead of the loads a prefetching task asks for (into all cache levels,
# as the GEMVs' parts.prefetch does)


def read_kernel(n_words: int, tasks: int, prefetch: bool) -> tirx.PrimFunc:
    """xor of all int32 words of `src` into out[task, lane]; each task reads one contiguous part."""
    step = LANES * UNROLL
    per_task = n_words // tasks // step * step
    ahead = PREFETCH_AHEAD // 4

    @T.prim_func
    def stream_read(src: T.Buffer((n_words,), "int32"), out: T.Buffer((tasks, LANES), "int32")) -> None:
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            acc = T.alloc_buffer((UNROLL, LANES), "int32")
            for u in range(UNROLL):
                for lane in T.vectorized(LANES):
                    acc[u, lane] = 0
            for i in range(per_task // step):
                base = T.meta_var(t * per_task + i * step)
                if prefetch:
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                                  T.address_of(src[T.min(base + ahead, n_words - 1)]),
                                                  T.int32(0), T.int32(3), T.int32(1)))
                for u in T.unroll(UNROLL):
                    for lane in T.vectorized(LANES):
                        acc[u, lane] = T.bitwise_xor(acc[u, lane], src[base + u * LANES + lane])
            for lane in T.vectorized(LANES):
                out[t, lane] = T.bitwise_xor(T.bitwise_xor(acc[0, lane], acc[1, lane]),
                                             T.bitwise_xor(acc[2, lane], acc[3, lane]))

    return stream_read


@functools.lru_cache(maxsize=8)
def compiled(n_words: int, tasks: int, prefetch: bool, target: str) -> Any:
    import tvm

    return tvm.compile(tvm.IRModule({"stream_read": read_kernel(n_words, tasks, prefetch)}), target=target)[
        "stream_read"]


def stream_read_gb_s(threads: int = 2, mib: int = 1024, repeats: int = 5) -> dict[str, Any]:
    """Best GB/s over `repeats` calls, with and without prefetch, and the xor checked against numpy."""
    import tvm

    from ggufc.codegen.target import cpu_target
    from ggufc.codegen.tvm_util import aligned_empty, to_tvm

    tvm.get_global_func("runtime.config_threadpool")(0, threads)
    n_words = mib * (1 << 20) // 4
    src = aligned_empty(n_words, np.int32)
    src[:] = np.arange(n_words, dtype=np.int32) * np.int32(-1640531535)  # every page touched
    out = np.zeros((threads, LANES), np.int32)
    src_t, out_t = to_tvm(src), to_tvm(out)
    result: dict[str, Any] = {"threads": threads, "mib": mib}
    read = n_words // threads // (LANES * UNROLL) * (LANES * UNROLL) * threads
    expect = np.bitwise_xor.reduce(src[:read].reshape(-1, LANES), axis=0)
    for prefetch in (False, True):
        fn = compiled(n_words, threads, prefetch, str(cpu_target(threads)))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(src_t, out_t)
            best = min(best, time.perf_counter() - t0)
        got = np.bitwise_xor.reduce(np.from_dlpack(out_t), axis=0)
        if not np.array_equal(got, expect):
            raise RuntimeError("stream-read kernel: wrong xor (the kernel skipped bytes)")
        result["prefetch" if prefetch else "plain"] = read * 4 / best / 1e9
    result["read_gb_s"] = max(result["plain"], result["prefetch"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps(stream_read_gb_s(args.threads, args.mib, args.repeats)))


if __name__ == "__main__":
    main()
