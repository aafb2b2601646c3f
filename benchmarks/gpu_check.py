"""Device check for the cuda target on a machine with an NVIDIA GPU (run by gpu_check.sh).

1. compiles SmolLM2-135M-Instruct Q4_1 for the GPU's architecture (`-t cuda --arch sm_XY`) and
   for the CPU, and reports whether the GPU loaded the artifact's prebuilt fatbin;
2. checks the GPU against llama.cpp's goldens (teacher-forced top-1 agreement on the shared
   prompts, as tests/test_smollm2.py does on CPU) and against the CPU artifact (NMSE of the
   logits in one-shot prefill, decode and chunks of 7);
3. measures prefill and decode tokens/s (decode runs as one CUDA graph per step) and the
   achieved memory bandwidth of the decode step: bytes it must read (every weight once, plus
   the KV cache rows in use) over its time, next to a device-to-device copy of 1 GiB.

Everything prints as it goes and a JSON summary ends the output; the exit status is non-zero
if a correctness check fails. Figures are never gates.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"
TIE_MARGIN = 0.25  # as tests/test_smollm2.py: about 2x the error of llama.cpp's 8-bit activations


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def gpu_arch() -> tuple[str, str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    name, cap = (s.strip() for s in out.rsplit(",", 1))
    return name, "sm_" + cap.replace(".", "")


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a.astype(np.float64) - b) ** 2) / np.mean(b.astype(np.float64) ** 2))


def teacher_forced(session, tokens: np.ndarray, chunk: int) -> np.ndarray:  # noqa: ANN001
    session.reset()
    rows = []
    for i in range(0, len(tokens), chunk):
        piece = tokens[i : i + chunk]
        rows.append(session.forward(piece)[None] if chunk == 1 else session.forward(piece, all_logits=True))
    return np.concatenate(rows)


def golden_agreement(session, golden: dict[str, np.ndarray]) -> tuple[int, int, int, int]:  # noqa: ANN001
    prompts = len(json.loads((GOLDEN / "shared_prompts.json").read_text()))
    agree = total = clear_agree = clear_total = 0
    for i in range(prompts):
        n = len(golden[f"p{i}_top_idx"])
        seq = np.concatenate([golden[f"p{i}_prompt"], golden[f"p{i}_greedy"]]).astype(np.int32)[:n]
        logits = teacher_forced(session, seq, len(seq))
        top_idx, top_val = golden[f"p{i}_top_idx"], golden[f"p{i}_top_val"]
        hits = logits.argmax(-1) == top_idx[:, 0]
        clear = (top_val[:, 0] - top_val[:, 1]) >= TIE_MARGIN
        agree, total = agree + int(hits.sum()), total + len(hits)
        clear_agree, clear_total = clear_agree + int(hits[clear].sum()), clear_total + int(clear.sum())
    return agree, total, clear_agree, clear_total


def copy_bandwidth(dev) -> float:  # noqa: ANN001
    import tvm

    n = 1 << 28  # 1 GiB of float32
    a = tvm.runtime.empty((n,), "float32", dev)
    b = tvm.runtime.empty((n,), "float32", dev)
    a.copyto(b)
    dev.sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.copyto(b)
        dev.sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * 4 * n / best / 1e9  # read + write


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    args = ap.parse_args()
    import tvm

    from ggufc.driver.compile import compile_model
    from ggufc.driver.models import default_model
    from ggufc.runtime import cuda_runtime
    from ggufc.runtime.session import Session

    summary: dict[str, object] = {}
    failures: list[str] = []
    name, arch = gpu_arch()
    log(f"GPU: {name} ({arch}); tvm {tvm.__version__}")
    summary["gpu"], summary["arch"] = name, arch
    model = default_model()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ggufc-gpu-check-"))
    t0 = time.perf_counter()
    gpu_art, cpu_art = work / "smollm2-cuda", work / "smollm2-cpu"
    os.environ.setdefault("TVM_NUM_THREADS", str(min(16, os.cpu_count() or 1)))
    compile_model(model, f"cuda:{arch}", gpu_art, n_ctx=args.ctx, progress=log)
    summary["compile_cuda_s"] = round(time.perf_counter() - t0, 1)
    t1 = time.perf_counter()
    compile_model(model, "llvm", cpu_art, n_ctx=args.ctx, progress=lambda s: None)
    summary["compile_cpu_s"] = round(time.perf_counter() - t1, 1)
    log(f"compiled: cuda {summary['compile_cuda_s']} s, cpu {summary['compile_cpu_s']} s")
    manifest = json.loads((gpu_art / "manifest.json").read_text())
    log(f"cuda graph: {manifest['gpu']['cuda']['cuda_graph']['decode']}")

    golden = dict(np.load(GOLDEN / "smollm2-shared.npz"))
    with Session(gpu_art, device="cuda") as gpu, Session(cpu_art) as cpu:
        log(f"fatbin loads: {cuda_runtime.CUDA_LOADS} (prebuilt = the artifact's kernels, no JIT)")
        summary["cuda_loads"] = dict(cuda_runtime.CUDA_LOADS)
        if cuda_runtime.CUDA_LOADS["compiled"]:
            failures.append("the GPU compiled CUDA source instead of using the artifact's fatbin")
        agree, total, clear_agree, clear_total = golden_agreement(gpu, golden)
        log(f"llama.cpp goldens: top-1 {agree}/{total}, away from near-ties {clear_agree}/{clear_total}")
        summary["golden_top1"] = [agree, total, clear_agree, clear_total]
        if agree / total < 0.975 or clear_agree / clear_total < 0.995:
            failures.append("top-1 agreement with llama.cpp below the CPU target's bar")
        seq = np.concatenate([golden["p0_prompt"], golden["p0_greedy"]]).astype(np.int32)
        for mode, chunk in (("prefill", len(seq)), ("decode", 1), ("chunk7", 7)):
            g, c = teacher_forced(gpu, seq, chunk), teacher_forced(cpu, seq, chunk)
            err = nmse(g, c)
            same = float(np.mean(g.argmax(-1) == c.argmax(-1)))
            log(f"GPU vs CPU logits, {mode}: NMSE {err:.2e}, argmax agreement {same:.3f}")
            summary[f"nmse_vs_cpu_{mode}"] = err
            if err > 1e-4:
                failures.append(f"GPU and CPU logits differ ({mode}: NMSE {err:.2e})")

        # throughput: prefill of a random prompt, then greedy decode (one CUDA graph per step)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, gpu.n_vocab, args.prompt_tokens).astype(np.int32)
        best_p = best_d = float("inf")
        for _ in range(3):
            gpu.reset()
            t = time.perf_counter()
            logits = gpu.forward(prompt)
            best_p = min(best_p, time.perf_counter() - t)
            tok = int(np.argmax(logits))
            t = time.perf_counter()
            for _ in range(args.gen_tokens):
                tok = int(np.argmax(gpu.forward(np.array([tok], np.int32))))
            best_d = min(best_d, time.perf_counter() - t)
        decode_s = best_d / args.gen_tokens
        hp = manifest["hparams"]
        kv_row = 2 * int(hp["n_layer"]) * int(hp.get("n_head_kv") or hp["n_head"]) * \
            int(hp.get("head_dim") or int(hp["n_embd"]) // int(hp["n_head"])) * 4
        avg_ctx = args.prompt_tokens + args.gen_tokens / 2
        bytes_step = int(manifest["weight_bytes"]) + kv_row * avg_ctx
        bw = bytes_step / decode_s / 1e9
        peak = copy_bandwidth(tvm.cuda(0))
        summary.update(prefill_tok_s=args.prompt_tokens / best_p, decode_tok_s=1 / decode_s,
                       decode_step_ms=decode_s * 1e3, decode_bytes_per_step=bytes_step, decode_gb_s=bw,
                       d2d_copy_gb_s=peak)
        log(f"prefill {args.prompt_tokens} tokens: {args.prompt_tokens / best_p:,.0f} tok/s")
        log(f"decode: {1 / decode_s:,.1f} tok/s ({decode_s * 1e3:.3f} ms/step, host loop and logits copy included)")
        log(f"decode step reads {bytes_step / 1e6:.1f} MB (weights {int(manifest['weight_bytes']) / 1e6:.1f} MB + "
            f"KV cache): {bw:,.1f} GB/s achieved; device-to-device copy {peak:,.0f} GB/s "
            f"({100 * bw / peak:.1f} % of it)")
    summary["failures"] = failures
    print(json.dumps(summary, default=lambda o: o if isinstance(o, (int, float, str)) else str(o)))
    for f in failures:
        log(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
