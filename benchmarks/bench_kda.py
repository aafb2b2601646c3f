"""KDA prefill on the CPU: the sequential delta-rule scan vs its chunked (WY / UT) form, one run.

Builds the `gated_delta_net` kernel twice for one layer size (the sequential form only, and the
chunked form for every call), with KDA's decay per key index (`--gate key`, the default) or the
gated delta-net's one decay per head (`--gate head`: the kernel takes it, while lowering keeps
that model family on the recurrence for now), runs both on the same random inputs
(L2-normalised q/k, a lower-bound style gate, a nonzero state) for each call length, and reports the
best and median milliseconds of each in alternating rounds (machine load hits both alike), the
ratio, and each form's error against the float64 sequential reference (max abs of o and of the new
state over the reference's largest value).

    python -m benchmarks.bench_kda [--gate key|head] [--heads 32] [--dim 128] [--tokens 1 8 16 64 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from ggufc.codegen.families import linear_attention as LA
from ggufc.codegen.target import resolve_target  # noqa: E402
from ggufc.ir import linear_attention as R  # noqa: E402


def inputs(t: int, h: int, d: int, key_decay: bool, seed: int = 0) -> tuple[np.ndarray, ...]:
    """state, q, k, v, g (-5 * sigmoid, per key index or per head), beta, all float32."""
    rng = np.random.default_rng(seed)
    q = R.l2_norm_ref(rng.normal(size=(t, h, d)), 1e-6)
    k = R.l2_norm_ref(rng.normal(size=(t, h, d)), 1e-6)
    v = rng.normal(size=(t, h, d))
    g = -5.0 / (1.0 + np.exp(3.0 - rng.normal(size=(t, h, d) if key_decay else (t, h))))  # mostly mild decay
    beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(t, h))))
    state = rng.normal(size=(h, d, d)) * 0.1
    return tuple(x.astype(np.float32) for x in (state, q, k, v, g, beta))


def build(h: int, d: int, key_decay: bool, chunked_from: int) -> Any:
    f = LA.gated_delta_net(h, d, d, h, "tiled", d**-0.5, key_decay=key_decay, chunked_from=chunked_from)
    return tvm.compile(tvm.IRModule({"main": f}), target=resolve_target("llvm"))["main"]


def run(fn: Any, args: tuple[np.ndarray, ...]) -> tuple[float, np.ndarray, np.ndarray]:
    dev = tvm.cpu()
    state, *rest = args
    s = tvm.runtime.tensor(state.copy(), dev)
    o = tvm.runtime.tensor(np.zeros_like(rest[2]), dev)
    ins = [tvm.runtime.tensor(x, dev) for x in rest]
    t0 = time.perf_counter()
    fn(s, *ins, o)
    return time.perf_counter() - t0, s.numpy(), o.numpy()


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", choices=["key", "head"], default="key", help="decay per key index (KDA) or per head")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64, 512])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    key = a.gate == "key"
    forms = {"sequential": build(a.heads, a.dim, key, 0), "chunked": build(a.heads, a.dim, key, 1)}
    kind = "KDA" if key else "gated delta-net"
    print(f"{kind} layer: {a.heads} heads, head dim {a.dim}, {os.environ['TVM_NUM_THREADS']} threads, "
          f"chunk {LA.CHUNK}; the compiled kernel switches to the chunked form from {LA.CHUNKED_FROM} tokens")
    print(f"{'tokens':>6} {'seq best ms':>11} {'seq med ms':>10} {'chk best ms':>11} {'chk med ms':>10} "
          f"{'speedup':>7} {'seq err o/S':>17} {'chk err o/S':>17}")
    for t in a.tokens:
        args = inputs(t, a.heads, a.dim, key)
        ref_s, ref_o = R.gated_delta_net_ref(*(x.astype(np.float64) for x in args), "tiled", a.dim**-0.5)
        times: dict[str, list[float]] = {name: [] for name in forms}
        errs: dict[str, str] = {}
        for _ in range(a.rounds):
            for name, fn in forms.items():
                sec, s, o = run(fn, args)
                times[name].append(sec * 1e3)
                errs[name] = f"{rel_err(o, ref_o):.1e}/{rel_err(s, ref_s):.1e}"
        seq, chk = times["sequential"], times["chunked"]
        print(f"{t:>6} {min(seq):>11.2f} {np.median(seq):>10.2f} {min(chk):>11.2f} {np.median(chk):>10.2f} "
              f"{np.median(seq) / np.median(chk):>7.2f} {errs['sequential']:>17} {errs['chunked']:>17}")


if __name__ == "__main__":
    main()
