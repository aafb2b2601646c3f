"""A model's decode step with default kernels vs with a `ggufc tune` database, in one run.

    python -m benchmarks.bench_tuning --db DIR [MODEL.gguf] [--tune-minutes 30] [--rounds 9] [--json OUT]

With `--tune-minutes M`, first runs a `ggufc tune` session of that budget into DIR. Then, in one
process and one run (so machine load hits both sides alike):

1. Read bandwidth: the stream-read roofline (`stream_read.py`: 64-byte loads over 1 GiB, one part
   per thread, the roofline of `bench_side_by_side.py`), the ceiling a decode step's weight reads
   can reach on this machine, and a parallel float sum over a buffer larger than the last-level
   cache (an ordinary TVM-built reduction, for comparison).
2. Per tuned workload of the model in DIR: its default and tuned kernels timed in interleaved
   rounds, both with the same arguments on every call (cache-hot, as `ggufc tune` times them) and
   cycling through copies of the arguments larger than the last-level cache (cold, as a decode
   step reads its weights); the bytes a call reads and the cold default's and tuned kernel's
   fractions of the stream-read roofline; and for the kernels that read weights, the workload's
   own read floor: the stream-read kernel reading the same bytes in one call, timed cold the same
   way (the per-call thread start and memory ramp included), with the default's and tuned
   kernel's fractions of it (near 1: no setting can make that kernel much faster).
3. The decode step: the model compiled without and with `--tuning-db DIR`, decode steps of both
   artifacts timed in alternating rounds (the order flips every round), medians, the ratio, and
   whether their logits are bit-identical (they are when only knob settings were applied). This
   part runs in a fresh process: after the kernel timings had allocated and freed gigabytes of
   argument copies, the artifact loaded first ran 8 % slower in every round (26.7 against 24.4
   ms, the same two artifacts giving 24.65 ms each in a fresh process), a bias of that process,
   not of its kernels.

The load average is printed before and after; on a shared machine rerun it when it is quiet.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from benchmarks.stream_read import LANES, UNROLL, read_kernel, stream_read_gb_s
from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.kernel_keys import OpKernel  # noqa: E402
from ggufc.driver.compile import compile_model  # noqa: E402
from ggufc.driver.models import default_model  # noqa: E402
from ggufc.driver.tune import worker as W  # noqa: E402
from ggufc.driver.tune.database import TuningDB  # noqa: E402
from ggufc.driver.tune.options import TuneOptions  # noqa: E402
from ggufc.driver.tune.session import tune_model  # noqa: E402
from ggufc.driver.tune.targets import tune_target  # noqa: E402
from ggufc.driver.tune.workloads import Workload, extract_workloads, knob_kernel, reads_from_memory  # noqa: E402
from ggufc.frontend.load import load_model  # noqa: E402
from ggufc.runtime.session import Session  # noqa: E402

MIB = 1 << 20
MAX_COPIES = 1024  # argument sets a cold timing cycles through at most (tiny kernels stay cache-warm)


def load() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


# -- read bandwidth ------------------------------------------------------------------------------


def read_bandwidth(target: tvm.target.Target, nbytes: int, repeats: int = 7) -> float:
    """Bytes per second of a parallel float32 sum over `nbytes` (median of `repeats`)."""
    tasks, lanes = 64, 64
    per_task = nbytes // 4 // tasks // lanes * lanes

    @T.prim_func
    def read_sum(x: T.Buffer((tasks, per_task), "float32"), out: T.Buffer((tasks, lanes), "float32")):
        for p in T.parallel(tasks):
            acc = T.decl_buffer((lanes,), "float32")
            for lane in T.vectorized(lanes):
                acc[lane] = T.float32(0)
            for i in range(per_task // lanes):
                for lane in T.vectorized(lanes):
                    acc[lane] = acc[lane] + x[p, i * lanes + lane]
            for lane in T.vectorized(lanes):
                out[p, lane] = acc[lane]

    func = tvm.compile(tvm.IRModule({"main": read_sum.with_attr("global_symbol", "main")}), target=target)
    dev = tvm.cpu()
    x = tvm.runtime.tensor(np.ones((tasks, per_task), "float32"), dev)
    out = tvm.runtime.empty((tasks, lanes), "float32", dev)
    func.mod["main"](x, out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        func.mod["main"](x, out)
        times.append(time.perf_counter() - t0)
    return 4 * tasks * per_task / float(np.median(times))


# -- per-workload kernels -----------------------------------------------------------------------


def bytes_read(w: Workload) -> int:
    """Bytes one call reads and writes: every tensor argument, the KV cache only up to the timing
    position for attention (a decode step reads the visible cells)."""
    total = 0
    for i, (dtype, shape) in enumerate(w.args):
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize if shape else 0
        if isinstance(w.key, OpKernel) and w.key.op == "attention" and i in (1, 2):
            n = n * (KN.TIMING_POSITION + 1) // int(shape[0])
        total += n
    return total


def argument_copies(specs: Sequence[tuple[str, tuple[int, ...]]], copies: int) -> list[list[Any]]:
    first = W.timing_args(specs, tvm.cpu(), KN.TIMING_POSITION)
    sets = [first]
    for _ in range(copies - 1):
        sets.append([a if isinstance(a, int) else tvm.runtime.tensor(a.numpy(), tvm.cpu()) for a in first])
    return sets


def time_kernels(funcs: Sequence[Callable[..., Any]], arg_sets: list[list[Any]], rounds: int,
                 min_seconds: float = 0.05) -> list[float]:
    """Median seconds per call of each function, in rounds that alternate which goes first; each
    round calls a function at least len(arg_sets) times, cycling through the argument sets."""
    for f in funcs:
        f(*arg_sets[0])
    t0 = time.perf_counter()
    funcs[0](*arg_sets[0])
    one = max(time.perf_counter() - t0, 1e-6)
    calls = max(len(arg_sets), int(min_seconds / one))
    samples: list[list[float]] = [[] for _ in funcs]
    for r in range(rounds):
        order = range(len(funcs)) if r % 2 == 0 else reversed(range(len(funcs)))
        for i in order:
            t0 = time.perf_counter()
            for c in range(calls):
                funcs[i](*arg_sets[c % len(arg_sets)])
            samples[i].append((time.perf_counter() - t0) / calls)
    return [float(np.median(s)) for s in samples]


def read_floor_seconds(nbytes: int, target: tvm.target.Target, cold_bytes: int, rounds: int) -> float:
    """Seconds per call of the stream-read kernel (with and without software prefetch, the faster)
    reading `nbytes` in one call on every thread, cycling through copies larger than `cold_bytes`:
    the least time any kernel that reads a workload's bytes from memory in one call can take."""
    threads = int(os.environ["TVM_NUM_THREADS"])
    step = LANES * UNROLL * threads
    n_words = max(step, nbytes // 4 // step * step)
    copies = min(MAX_COPIES, max(2, -(-cold_bytes // (4 * n_words))))
    rng = np.random.default_rng(0)
    out = tvm.runtime.empty((threads, LANES), "int32", tvm.cpu())
    sets = [[tvm.runtime.tensor(rng.integers(-2**31, 2**31 - 1, n_words, dtype=np.int32), tvm.cpu()), out]
            for _ in range(copies)]
    funcs = [compiled(read_kernel(n_words, threads, prefetch), target) for prefetch in (False, True)]
    return min(time_kernels(funcs, sets, rounds)) * nbytes / (4 * n_words)


def tuned_kernel(db: TuningDB, w: Workload, e: dict[str, Any], target: tvm.target.Target) -> Any:
    if e.get("search") == "knobs":  # no knobs recorded: the default setting timed best
        return knob_kernel(w.key, target, e["knobs"]) if e.get("knobs") else w.default
    assert w.func is not None
    return db.best_schedule(w.hash, w.func, target)


def compiled(func: Any, target: tvm.target.Target) -> Callable[..., Any]:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target).mod["main"]


def workload_rows(model: Path, db_dir: str, target: tvm.target.Target, bandwidth: float, cold_bytes: int,
                  rounds: int) -> list[dict[str, Any]]:
    db = TuningDB(db_dir)
    rows = []
    for w in extract_workloads(load_model(model), target):
        e = db.entry(w.hash)
        if e is None or not e.get("tuned_us"):
            continue
        tuned = tuned_kernel(db, w, e, target)
        if tuned is None:
            continue
        funcs = [compiled(w.default, target), compiled(tuned, target)]
        nbytes = bytes_read(w)
        hot = time_kernels(funcs, argument_copies(w.args, 1), rounds)
        copies = min(MAX_COPIES, max(2, -(-cold_bytes // max(nbytes, 1))))
        cold = time_kernels(funcs, argument_copies(w.args, copies), rounds)
        floor = read_floor_seconds(nbytes, target, cold_bytes, rounds) if reads_from_memory(w) else None
        rows.append({"label": w.label, "calls": w.calls, "search": w.search, "knobs": e.get("knobs"),
                     "trials": e.get("trials"), "db_speedup": e.get("speedup"), "bytes": nbytes,
                     "hot_default_us": 1e6 * hot[0], "hot_tuned_us": 1e6 * hot[1],
                     "cold_default_us": 1e6 * cold[0], "cold_tuned_us": 1e6 * cold[1],
                     "cold_default_bw_fraction": nbytes / cold[0] / bandwidth,
                     "cold_tuned_bw_fraction": nbytes / cold[1] / bandwidth,
                     "read_floor_us": None if floor is None else 1e6 * floor,
                     "cold_default_floor_fraction": None if floor is None else floor / cold[0],
                     "cold_tuned_floor_fraction": None if floor is None else floor / cold[1]})
    return rows


def print_workloads(rows: list[dict[str, Any]]) -> None:
    print(f"{'workload':<44} {'calls':>5} {'MiB':>6} {'hot def/tuned us':>19} {'ratio':>6} "
          f"{'cold def/tuned us':>19} {'ratio':>6} {'BW def':>6} {'BW tun':>6} {'floor us':>9} "
          f"{'F def':>5} {'F tun':>5}  knobs")
    for r in rows:
        knobs = ",".join(f"{k}={v}" for k, v in (r["knobs"] or {}).items()) or r["search"]
        hot, cold = (r["hot_default_us"], r["hot_tuned_us"]), (r["cold_default_us"], r["cold_tuned_us"])
        print(f"{r['label'][:44]:<44} {r['calls']:>5} {r['bytes'] / MIB:>6.2f} "
              f"{hot[0]:>9.1f}/{hot[1]:<9.1f} {hot[0] / hot[1]:>6.3f} {cold[0]:>9.1f}/{cold[1]:<9.1f} "
              f"{cold[0] / cold[1]:>6.3f} {r['cold_default_bw_fraction']:>6.2f} "
              f"{r['cold_tuned_bw_fraction']:>6.2f} {_floor_columns(r)}  {knobs}")


def _floor_columns(r: dict[str, Any]) -> str:
    """The workload's read floor and the cold kernels' fractions of it ('-' where it reads no weights)."""
    if r["read_floor_us"] is None:
        return f"{'-':>9} {'-':>5} {'-':>5}"
    return (f"{r['read_floor_us']:>9.1f} {r['cold_default_floor_fraction']:>5.2f} "
            f"{r['cold_tuned_floor_fraction']:>5.2f}")


# -- decode step -------------------------------------------------------------------------------


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


def decode_step(model: Path, db_dir: str, root: Path, tokens: int, rounds: int, min_speedup: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    compile_model(model, "llvm", root / "default")
    t1 = time.perf_counter()
    tuned = compile_model(model, "llvm", root / "tuned", tuning_db=db_dir, tuning_min_speedup=min_speedup)
    print(f"compile: default {t1 - t0:.1f} s, with database {time.perf_counter() - t1:.1f} s; "
          f"{len(tuned['tuning']['kernels'])} kernels from the database, "
          f"{len(tuned['tuning']['kept_default'])} kept their default")
    for name, why in sorted(tuned["tuning"]["kept_default"].items()):
        print(f"  kept default {name}: {why}")
    prompt = np.random.default_rng(0).integers(0, tuned["n_vocab"], size=8).astype(np.int32)
    times: dict[str, list[float]] = {"default": [], "tuned": []}
    with Session(root / "default") as a, Session(root / "tuned") as b:
        sides = {"default": a, "tuned": b}
        for s in sides.values():
            decode_seconds(s, prompt, 4)  # warm-up
        for r in range(rounds):
            for name in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
                times[name].append(decode_seconds(sides[name], prompt, tokens))
        identical = same_logits(a, b, prompt)
    out: dict[str, Any] = {k: {"best_ms": 1e3 * min(v), "median_ms": 1e3 * float(np.median(v)),
                               "all_ms": [round(1e3 * x, 3) for x in v]} for k, v in times.items()}
    out["speedup_median"] = out["default"]["median_ms"] / out["tuned"]["median_ms"]
    out["logits_identical"] = identical
    out["tuned_kernels"] = len(tuned["tuning"]["kernels"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--db", required=True, help="ggufc tune database")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=9, help="decode rounds per side (and kernel timing rounds)")
    ap.add_argument("--min-speedup", type=float, default=1.0, help="compile's --tuning-min-speedup")
    ap.add_argument("--out", default=None, help="keep the two artifacts here (default: a temporary directory)")
    ap.add_argument("--tune-minutes", type=float, default=None, help="first tune into --db for this long")
    ap.add_argument("--trials-per-round", type=int, default=16)
    ap.add_argument("--only", action="append", default=None, metavar="KIND", help="with --tune-minutes")
    ap.add_argument("--skip-kernels", action="store_true", help="only the decode step")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_model()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-tuning-"))
    target = tune_target("llvm")
    result: dict[str, Any] = {"model": model.name, "db": args.db, "cpus": len(os.sched_getaffinity(0)),
                              "load_before": os.getloadavg()}
    print(f"{model.name}, {result['cpus']} CPUs, {load()}")
    if args.tune_minutes:
        summary = tune_model(model, "llvm", args.db, time_budget_s=60.0 * args.tune_minutes, kinds=args.only,
                                options=TuneOptions.for_round(args.trials_per_round))
        print(summary.format())
    llc = W.last_level_cache_bytes()
    cold_bytes = 2 * llc
    summed = read_bandwidth(target, max(cold_bytes, 512 * MIB))
    stream = stream_read_gb_s(result["cpus"], 1024)
    bandwidth = 1e9 * stream["read_gb_s"]
    result.update(last_level_cache_mib=llc / MIB, read_bandwidth_gbs=bandwidth / 1e9, stream_read=stream,
                  parallel_sum_gbs=summed / 1e9)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s stream-read roofline (1 GiB); parallel float sum over "
          f"{max(cold_bytes, 512 * MIB) / MIB:.0f} MiB {summed / 1e9:.1f} GB/s; last-level cache {llc / MIB:.0f} MiB; "
          f"{load()}")
    if not args.skip_kernels:
        rows = workload_rows(model, args.db, target, bandwidth, cold_bytes, args.rounds)
        print_workloads(rows)
        result["workloads"] = rows
        print(load())
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
        step = fresh.submit(decode_step, model, args.db, root, args.tokens, args.rounds, args.min_speedup).result()
    result["decode"] = step
    for k in ("default", "tuned"):
        print(f"{k:<8} decode step: best {step[k]['best_ms']:.2f} ms, median {step[k]['median_ms']:.2f} ms")
    gemv_bytes = sum(r["bytes"] * r["calls"] for r in result.get("workloads", []) if r["label"].startswith("matmul"))
    if gemv_bytes:
        floor_ms = 1e3 * gemv_bytes / bandwidth
        result["tuned_gemv_bytes_per_step"] = gemv_bytes
        print(f"the tuned GEMVs read {gemv_bytes / MIB:.0f} MiB per step: {floor_ms:.2f} ms at the read bandwidth, "
              f"{floor_ms / step['default']['median_ms']:.2f} of the default step's median")
    print(f"tuned vs default (median): {step['speedup_median']:.3f}x; logits bit-identical: {step['logits_identical']}")
    result["load_after"] = os.getloadavg()
    print(load())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
