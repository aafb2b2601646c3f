"""Where a decode step's time goes: each kernel's time and the bytes its arguments span (so its
read bandwidth and share of the stream-read roofline), and the Relax VM's builtin calls.

    python -m benchmarks.decode_profile ARTIFACT [--threads 2] [--steps 8] [--context 64]
        [--batch P]

--batch P profiles the batched decode step of `ggufc serve --parallel P` instead (`decode_batch`:
one token of each of P slots, every slot holding the context).

The VM's instrument hook timestamps each call before and after it, so a kernel's time excludes
the VM's own work and the hook's Python; the step is also timed whole without the hook. Bytes are
the sizes of the kernel's weight and activation arguments (outputs included), without the states
(the KV cache, of which a step reads only the filled rows; so attention and cache writes show no
bandwidth) and without tables of which a kernel reads one row (the token embedding, the rope
table). The stream read (`stream_read.py`) is measured in the same run, after the profile.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

KERNEL = re.compile(r"k\d{3}_")
ROW_READ = re.compile(r"_(embed|rope)$")  # kernels reading a few rows of a big table


def tensor_bytes(args: tuple[Any, ...], skip: set[int]) -> int:
    """Bytes of the tensor arguments whose data pointers are not in `skip`."""
    total = 0
    for a in args:
        shape = getattr(a, "shape", None)
        if shape is not None and hasattr(a, "dtype") and data_pointer(a) not in skip:
            total += int(np.prod([int(d) for d in shape])) * np.dtype(str(a.dtype)).itemsize
    return total


def data_pointer(a: Any) -> int:
    return int(np.from_dlpack(a).ctypes.data)


class StepProfile:
    """Per-kernel-call times and bytes, and builtin counts, over the steps run while installed."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip
        self.times: dict[str, list[float]] = defaultdict(list)
        self.nbytes: dict[str, int] = {}
        self.builtins: Counter[str] = Counter()
        self._t0 = 0.0

    def __call__(self, func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
        if before:
            if KERNEL.match(symbol) and symbol not in self.nbytes:
                self.nbytes[symbol] = 0 if ROW_READ.search(symbol) else tensor_bytes(args, self.skip)
            self._t0 = time.perf_counter()
            return 0
        dt = time.perf_counter() - self._t0
        if KERNEL.match(symbol):
            self.times[symbol].append(dt)
        else:
            self.builtins[symbol] += 1
        return 0


def decode_call(artifact: Path, threads: int, context: int,
                batch: int) -> tuple[Any, str, tuple[Any, ...], set[int], Any]:
    """A VM, the name of its decode step's function, its arguments (the position stays put: every step
    redoes the same one), the data pointers of the states, and what owns the states and weights."""
    import tvm

    from ggufc.runtime.session import Session
    from ggufc.runtime.slot_group import SlotGroup

    vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(artifact / "kernels.so")), tvm.cpu())
    prompt = np.arange(1, context + 1, dtype=np.int32)
    if not batch:
        session = Session(artifact, threads=threads)
        session.forward(prompt % session.n_vocab)
        args = (tvm.runtime.from_dlpack(session._token_buffer[:1]), tvm.runtime.ShapeTuple([session.n_past]),
                session._states, *session._params)
        return vm, "decode", args, {data_pointer(t) for t in session._state_tensors}, session
    group = SlotGroup(artifact, batch, threads=threads)
    if group.batch_refused is not None:
        raise SystemExit(f"{artifact}: no batched decode ({group.batch_refused})")
    for session in group.sessions:
        session.forward(prompt % session.n_vocab)
    rows = {"tokens": np.ones(batch, np.int32), "positions": np.full(batch, context, np.int32),
            "slots": np.arange(batch, dtype=np.int32)}
    args = (*(tvm.runtime.from_dlpack(group._rows[k][:batch]) for k in rows), group._stack.tensors(),
            *group.sessions[0]._params)
    for name, values in rows.items():
        group._rows[name][:batch] = values
    return vm, "decode_batch", args, {int(a.ctypes.data) for a in group._stack.arrays or []}, group


def profile(artifact: Path, threads: int, steps: int, context: int, batch: int = 0) -> dict[str, Any]:
    vm, name, args, states, _owner = decode_call(artifact, threads, context, batch)
    decode = vm[name]
    whole = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        decode(*args)
        whole.append(time.perf_counter() - t0)
    prof = StepProfile(states)
    vm.set_instrument(prof)
    for _ in range(steps):
        decode(*args)
    kernels = {}
    for sym, ts in prof.times.items():
        calls = len(ts) // steps
        per_call = statistics.median(ts)
        kernels[sym] = {"calls": calls, "ms": 1e3 * per_call * calls, "bytes": prof.nbytes[sym] * calls}
    return {"step_ms": 1e3 * statistics.median(whole[2:]), "kernels": kernels,
            "builtins": {k: v // steps for k, v in prof.builtins.most_common()},
            "launches": sum(k["calls"] for k in kernels.values())}


def family(symbol: str) -> str:
    return KERNEL.sub("", symbol)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="tokens in the context before the profiled step")
    ap.add_argument("--batch", type=int, default=0, help="profile the batched step of this many slots")
    args = ap.parse_args()
    from benchmarks.stream_read import stream_read_gb_s

    p = profile(args.artifact, args.threads, args.steps, args.context, args.batch)
    read = stream_read_gb_s(args.threads, mib=1024, repeats=5)["read_gb_s"]
    step = f"batched decode step of {args.batch} slots" if args.batch else "decode step"
    print(f"{args.artifact}: {step} {p['step_ms']:.3f} ms (median, no hook), {p['launches']} kernel calls, "
          f"{sum(p['builtins'].values())} VM builtin calls; stream read {read:.1f} GB/s")
    print(f"{'kernel':28s} {'calls':>5s} {'ms/step':>8s} {'MB/step':>8s} {'GB/s':>6s} {'of read':>7s}")
    total_ms = total_mb = 0.0
    for sym, k in sorted(p["kernels"].items(), key=lambda kv: -kv[1]["ms"]):
        gb_s = k["bytes"] / (k["ms"] * 1e-3) / 1e9 if k["ms"] else 0.0
        total_ms, total_mb = total_ms + k["ms"], total_mb + k["bytes"] / 1e6
        rate = f"{gb_s:6.1f} {100 * gb_s / read:6.0f} %" if k["bytes"] else f"{'-':>6s} {'-':>8s}"
        print(f"{sym:28s} {k['calls']:5d} {k['ms']:8.3f} {k['bytes'] / 1e6:8.1f} {rate}")
    print(f"{'kernels':28s} {p['launches']:5d} {total_ms:8.3f} {total_mb:8.1f} "
          f"{total_mb / total_ms:6.1f} {100 * total_mb / total_ms / read:6.0f} %")
    print(f"outside kernels (VM, launches): {p['step_ms'] - total_ms:.3f} ms of the {p['step_ms']:.3f} ms step")
    print("VM builtins per step:", ", ".join(f"{k.removeprefix('vm.builtin.')} {v}" for k, v in p["builtins"].items()))


if __name__ == "__main__":
    main()
