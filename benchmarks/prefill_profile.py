"""Where a prompt's time goes: each kernel family's time in one prefill call, for one or more
compiled artifacts of a model, their calls interleaved round by round.

    python -m benchmarks.prefill_profile ARTIFACT [ARTIFACT ...] [--tokens 128] [--rounds 8]

As decode_profile.py, the VM's instrument hook timestamps each call before and after it, so a
kernel's time excludes the VM's own work; a family is a kernel's name without its kXXX_ prefix
(every layer's call of it summed). Each figure is the best of the rounds: on a shared machine the
best round is the one least disturbed, and interleaving keeps the artifacts' figures comparable.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

KERNEL = re.compile(r"k\d{3}_")
BUILTINS = "(VM builtins)"


class CallTimes:
    """Seconds per kernel family (and the VM's builtins together) of the calls since `clear`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._t0 = 0.0

    def clear(self) -> None:
        self.seconds.clear()

    def __call__(self, func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
        if before:
            self._t0 = time.perf_counter()
            return 0
        family = KERNEL.sub("", symbol) if KERNEL.match(symbol) else BUILTINS
        self.seconds[family] += time.perf_counter() - self._t0
        return 0


class Profiled:
    """One artifact's prefill on a hooked VM of its own, over a session's states and weights."""

    def __init__(self, artifact: Path, prompt: np.ndarray, threads: int) -> None:
        import tvm

        from ggufc.runtime.session import Session

        self.name = artifact.name
        self.session = Session(artifact, threads=threads)
        vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(artifact / "kernels.so")), tvm.cpu())
        self.hook = CallTimes()
        vm.set_instrument(self.hook)
        self.prefill = vm["prefill"]
        tokens = self.session._token_buffer[: prompt.size]
        tokens[...] = prompt
        # position 0 every time: each call redoes the same prompt
        self.args = (tvm.runtime.from_dlpack(tokens), tvm.runtime.ShapeTuple([0]), self.session._states,
                     *self.session._params)
        self.rounds: dict[str, list[float]] = defaultdict(list)

    def run(self) -> None:
        self.hook.clear()
        t0 = time.perf_counter()
        self.prefill(*self.args)
        self.rounds["(whole call)"].append(time.perf_counter() - t0)
        self.rounds["(kernels)"].append(sum(s for f, s in self.hook.seconds.items() if f != BUILTINS))
        for family, s in self.hook.seconds.items():
            self.rounds[family].append(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompt = (np.arange(args.tokens, dtype=np.int32) * 37 + 11) % 40000 + 100  # prefill_ab.py's prompt
    runs = [Profiled(a, prompt, args.threads) for a in args.artifacts]
    for r in runs:
        r.run()  # warm-up, not kept
        r.rounds.clear()
    for _ in range(args.rounds):
        for r in runs:
            r.run()
            time.sleep(0.1)
    families = sorted(runs[0].rounds, key=lambda f: -min(runs[0].rounds[f]))
    print(f"prefill of {args.tokens} tokens, {args.threads} threads: ms, best of {args.rounds} rounds")
    print(f"{'kernel family':32s}" + "".join(f"{r.name:>12s}" for r in runs))
    for f in families:
        print(f"{f:32s}" + "".join(f"{1e3 * min(r.rounds[f]):12.2f}" if f in r.rounds else f"{'-':>12s}"
                                   for r in runs))
    print(f"{'(whole call, median)':32s}" + "".join(f"{1e3 * statistics.median(r.rounds['(whole call)']):12.2f}"
                                                  for r in runs))
    for r in runs:
        r.session.close()


if __name__ == "__main__":
    main()
