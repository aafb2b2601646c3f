"""ggufc against llama.cpp on the CPU, in one run: throughput, bandwidth, decode speed against context.

    python -m benchmarks.bench_cpu [--threads 2] [--prompt-tokens 64] [--gen-tokens 32]
                                   [--out benchmarks/results] [--contexts 0,256,512,1024] [--doc docs/performance.md]
    python -m benchmarks.bench_cpu --from-json benchmarks/results/bench_cpu.json --doc docs/performance.md

Everything is measured in the same process, interleaved (one ggufc repeat, then one llama.cpp
repeat, three rounds, best of each kept), because timings on a shared 2-vCPU VM vary by +-30 %:

* prefill tokens/s (a P-token random prompt) and decode tokens/s (G greedy tokens), ggufc and
  llama.cpp (through `llama-cpp-python` when importable; skipped cleanly when it is not), and ratios;
* a bandwidth reference from the same machine and run: a stream-like copy (numpy `copyto`, one
  half per thread, read + write bytes) and a read (OpenBLAS sgemv over a 256 MiB f32 matrix);
* the achieved bandwidth of the decode step (bytes of every weight + the KV cache read per token,
  times decode tokens/s) and of the largest quantized matrix-vector kernel (the Q8_0 output layer of
  SmolLM2, timed alone), each as a fraction of the reference;
* decode tokens/s against context length (a PNG plot, both engines);
* writes `OUT/bench_cpu.json`, `OUT/decode_vs_ctx.png`, and regenerates the results table in a docs
  page between `<!-- bench-cpu:begin -->` and `<!-- bench-cpu:end -->` (with `--doc`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

BEGIN, END = "<!-- bench-cpu:begin -->", "<!-- bench-cpu:end -->"


# ----------------------------------------------------------------------------------------- engines


class GgufcEngine:
    name = "ggufc"

    def __init__(self, model: Path, threads: int, artifact: Path | None = None, target: str = "llvm") -> None:
        """`artifact`: an already compiled one (default: the compile cache's, compiled if missing);
        `target`: what the cache's is compiled for (`llvm:haswell`: `--cpu haswell`)."""
        from ggufc.cli import cached_artifact_dir, compile_gguf
        from ggufc.runtime.session import Session

        self.artifact = artifact or cached_artifact_dir(model, target, None)
        if not (self.artifact / "manifest.json").is_file():
            compile_gguf(model, target, self.artifact, None)
        self.session = Session(self.artifact, threads=threads)
        self.n_vocab = self.session.n_vocab
        self.n_ctx = self.session.n_ctx

    def reset(self) -> None:
        self.session.reset()

    def feed(self, tokens: list[int]) -> int:
        """Feed tokens, return the greedy next token."""
        logits = self.session.forward(np.asarray(tokens, dtype=np.int32))
        return int(np.argmax(logits))

    def close(self) -> None:
        self.session.close()


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, model: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False, logits_all=False)
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()

    def feed(self, tokens: list[int]) -> int:
        self.llm.eval(tokens)  # with logits_all=False `scores` is not filled: read the last row's logits
        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))))

    def close(self) -> None:
        if hasattr(self.llm, "close"):
            self.llm.close()


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def time_once(engine: Any, prompt: list[int], gen_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one repeat from an empty context."""
    engine.reset()
    t0 = time.perf_counter()
    tok = engine.feed(prompt)
    t1 = time.perf_counter()
    for _ in range(gen_tokens):
        tok = engine.feed([tok])
    return t1 - t0, time.perf_counter() - t1


def decode_at(engine: Any, prefix: list[int], gen_tokens: int) -> float:
    """Decode tokens/s after `len(prefix)` tokens of context."""
    engine.reset()
    tok = engine.feed(prefix) if prefix else 1
    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        tok = engine.feed([tok])
    return gen_tokens / (time.perf_counter() - t0)


def settle() -> None:
    time.sleep(0.3)  # both thread pools spin-wait after a call: let the other one fall asleep


# -------------------------------------------------------------------------------------- bandwidth


def stream_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """Copy (read + write bytes, numpy copyto split over threads) and read (OpenBLAS sgemv) GB/s."""
    n = mib * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    parts = np.array_split(np.arange(n), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]

    def copy_part(lo: int, hi: int) -> None:
        np.copyto(dst[lo:hi], src[lo:hi])

    best_copy = float("inf")
    for _ in range(repeats):
        ts = [threading.Thread(target=copy_part, args=b) for b in bounds]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best_copy = min(best_copy, time.perf_counter() - t0)
    nbytes = n * 4
    return {"copy_gb_s": 2 * nbytes / best_copy / 1e9, "read_gb_s": sgemv_read(src, repeats),
            "array_mib": mib}


def sgemv_read(values: np.ndarray, repeats: int = 5) -> float:
    """GB/s of an OpenBLAS sgemv over `values` (a stream-like read: every byte once per call)."""
    mat = values[: values.size // 4096 * 4096].reshape(-1, 4096)
    x = np.ones(4096, np.float32)
    y = np.empty(mat.shape[0], np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(mat, x, out=y)
        best = min(best, time.perf_counter() - t0)
    return mat.nbytes / best / 1e9


def output_gemv_bandwidth(artifact: Path, repeats: int = 5) -> dict[str, Any]:
    """The largest quantized matrix-vector kernel of the model (by weight bytes), timed alone."""
    import tvm

    from ggufc.codegen.cpu_int8 import block32
    from ggufc.codegen.formats.cpu_schedules import qmatmul
    from ggufc.codegen.formats.table import get_format
    from ggufc.codegen.target import cpu_target
    from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
    from ggufc.runtime.artifact_reader import load_manifest, read_weights

    manifest = load_manifest(artifact)
    weights = read_weights(artifact, manifest)
    index, best = 0, None
    offset = 0
    for p in manifest["params"]:
        size = sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize for a in p["arrays"])
        if p["qtype"] not in ("F32", "F16", "BF16") and (best is None or size > best[1]):
            best = (p, size, offset)
        offset += len(p["arrays"])
    assert best is not None
    param, nbytes, index = best
    arrays = weights[index:index + len(param["arrays"])]
    shape = param["arrays"][-1]["shape"]
    fmt = get_format(param["qtype"])
    n, k = int(shape[0]), int(shape[1]) * fmt.block
    target = cpu_target()
    int8 = block32.int8_gemv_supported(param["qtype"], n, k, target)  # the kernel decode runs
    qtype = param["qtype"]
    func = block32.int8_gemv(qtype, n, k, target) if int8 else qmatmul(qtype, n, k, gemv=True)
    ex = tvm.compile(func, target=target)
    x = aligned_zeros((1, k), np.float32)
    x[:] = 0.01
    y = aligned_zeros((1, n), np.float32)
    args = [to_tvm(x), *(to_tvm(a) for a in arrays), to_tvm(y)]
    ev = ex.mod.time_evaluator("main", tvm.cpu(), number=1, repeat=repeats, min_repeat_ms=50)
    sec = float(min(ev(*args).results))
    return {"name": param["name"], "qtype": param["qtype"], "n": n, "k": k, "weight_bytes": nbytes,
            "kernel": "8-bit" if int8 else "float", "ms": sec * 1e3, "gb_s": nbytes / sec / 1e9}


def decode_bytes_per_token(manifest: dict[str, Any], n_past: int) -> int:
    """Weights (the token embedding row only when it is not also the output layer) + KV read."""
    total = int(manifest["weight_bytes"])
    hp = manifest.get("hparams", {})
    n_layer = int(hp.get("n_layer", hp.get("block_count", 0)) or 0)
    n_kv = int(hp.get("n_head_kv", hp.get("head_count_kv", 0)) or 0)
    head_dim = int(hp.get("head_dim", 0) or 0)
    if not head_dim and hp.get("n_embd") and hp.get("n_head"):
        head_dim = int(hp["n_embd"]) // int(hp["n_head"])
    kv = 2 * n_layer * n_kv * head_dim * 4 * n_past
    return total + kv


# ------------------------------------------------------------------------------------------ report


def plot(path: Path, curves: dict[str, list[tuple[int, float]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("context length (tokens already cached)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_table(r: dict[str, Any], plot_link: str) -> str:
    g, ref = r["ggufc"], r.get("llama.cpp")
    lines = [
        f"Machine: {r['machine']}; {r['threads']} threads; {r['date']}; model {r['model_name']}; "
        f"prompt {r['prompt_tokens']} tokens, {r['gen_tokens']} generated, best of {r['repeats']} "
        f"(`python -m benchmarks.bench_cpu`)."
        + (f" 1-minute load average {r['load_avg_1min'][0]:.1f} at the start, {r['load_avg_1min'][1]:.1f} at the end "
           f"(other jobs on the machine: above {r['threads']} the engines share cores and both slow down, "
           "llama.cpp's spinning OpenMP pool far more)." if "load_avg_1min" in r else ""),
        "",
        "| figure | ggufc | llama.cpp | ggufc / llama.cpp |",
        "|---|---:|---:|---:|",
    ]
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
        if ref:
            lines.append(f"| {label} | {g[key]:.1f} | {ref[key]:.1f} | {g[key] / ref[key]:.2f}x |")
        else:
            lines.append(f"| {label} | {g[key]:.1f} | not installed | - |")
    bw = r["bandwidth"]
    lines += [
        "",
        "| bandwidth | GB/s | of stream read |",
        "|---|---:|---:|",
        f"| stream-like read (sgemv, {bw['array_mib']} MiB) | {bw['read_gb_s']:.1f} | 100 % |",
        f"| stream-like copy (read + write) | {bw['copy_gb_s']:.1f} | - |",
        f"| ggufc decode step ({r['decode_bytes'] / 1e6:.1f} MB/token) | {r['decode_gb_s']:.1f} | "
        f"{100 * r['decode_gb_s'] / bw['read_gb_s']:.0f} % |",
    ]
    if "same_size_read_gb_s" in bw:
        lines.append(f"| stream-like read of a decode step's size ({r['decode_bytes'] / 1e6:.1f} MB; "
                     f"the decode step reaches {100 * r['decode_gb_s'] / bw['same_size_read_gb_s']:.0f} % of it) | "
                     f"{bw['same_size_read_gb_s']:.1f} | {100 * bw['same_size_read_gb_s'] / bw['read_gb_s']:.0f} % |")
    k = r.get("largest_gemv")
    if k:
        kernel = f"{k['kernel']} kernel, " if "kernel" in k else ""
        lines.append(f"| largest quantized GEMV ({k['name']} {k['qtype']} {k['n']}x{k['k']}, {kernel}"
                     f"{k['ms']:.2f} ms) | {k['gb_s']:.1f} | {100 * k['gb_s'] / bw['read_gb_s']:.0f} % |")
    c = r.get("compile_seconds")
    if c:
        lines += ["", f"Compile (llvm): {c.get('cold', float('nan')):.1f} s cold, "
                      f"{c.get('cached', float('nan')):.2f} s from cache."]
    lines += ["", f"![decode tokens/s against context length]({plot_link})"]
    return "\n".join(lines)


def plot_link(plot: Path, doc: Path | None) -> str:
    """The plot's path as the page that shows it links it (relative to the page's folder)."""
    return os.path.relpath(plot.resolve(), (doc or Path.cwd() / "x").resolve().parent)


def update_doc(doc: Path, table: str) -> None:
    text = doc.read_text(encoding="utf-8")
    block = f"{BEGIN}\n{table}\n{END}"
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n## CPU results (ggufc vs llama.cpp)\n\n" + block + "\n"
    doc.write_text(text, encoding="utf-8")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import tvm

        cpu += f" ({tvm.target.codegen.llvm_get_system_cpu()})"
    except Exception:  # noqa: BLE001
        pass
    return f"{cpu}, {os.cpu_count()} vCPUs"


def compile_times(model: Path, out: Path) -> dict[str, float]:
    """Cold compile into a fresh cache, then the cached path (`ggufc bench`'s lookup), in subprocesses."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GGUFC_CACHE=tmp)
        code = ("import sys,time;t=time.perf_counter();from ggufc.cli import cached_artifact_dir,compile_gguf;"
                "from pathlib import Path;m=Path(sys.argv[1]);a=cached_artifact_dir(m,'llvm',None);"
                "(a/'manifest.json').is_file() or compile_gguf(m,'llvm',a,None);"
                "from ggufc.runtime.session import Session;Session(a).close();print(time.perf_counter()-t)")
        res = {}
        for key in ("cold", "cached"):
            p = subprocess.run([sys.executable, "-c", code, str(model)], env=env, capture_output=True, text=True,
                               check=True)
            res[key] = float(p.stdout.strip().splitlines()[-1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contexts", default="0,256,512,1024", help="context lengths for the decode plot")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--doc", type=Path, default=None,
                    help="docs page to regenerate the results table in (docs/performance.md)")
    ap.add_argument("--compile-times", action="store_true", help="also time a cold and a cached compile")
    ap.add_argument("--from-json", metavar="JSON", help="only regenerate the docs table from a results JSON")
    args = ap.parse_args()
    if args.from_json:
        plot = Path(args.from_json).parent / "decode_vs_ctx.png"
        table = results_table(json.loads(Path(args.from_json).read_text(encoding="utf-8")), plot_link(plot, args.doc))
        print(table)
        if args.doc:
            update_doc(args.doc, table)
        return
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    from ggufc.driver.models import default_model

    model = Path(args.model) if args.model else default_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    engines: list[Any] = [GgufcEngine(model, args.threads)]
    n_ctx = engines[0].n_ctx
    if llama_cpp_available():
        engines.append(LlamaCppEngine(model, args.threads, n_ctx))
    else:
        print("llama.cpp: llama_cpp not importable; measuring ggufc only (pip install llama-cpp-python)")
    rng = np.random.default_rng(0)
    n_vocab = min(e.n_vocab for e in engines)
    prompt = rng.integers(0, n_vocab, size=args.prompt_tokens).tolist()

    best = {e.name: [float("inf"), float("inf")] for e in engines}
    for _ in range(args.repeats):  # interleaved rounds
        for e in engines:
            p, d = time_once(e, prompt, args.gen_tokens)
            best[e.name] = [min(best[e.name][0], p), min(best[e.name][1], d)]
            settle()
    results: dict[str, Any] = {
        name: {"prefill_tok_s": args.prompt_tokens / p, "decode_tok_s": args.gen_tokens / d}
        for name, (p, d) in best.items()
    }

    contexts = [c for c in (int(x) for x in args.contexts.split(",")) if c + args.gen_tokens + 1 < n_ctx]
    long_prompt = rng.integers(0, n_vocab, size=max(contexts, default=0)).tolist()
    curves: dict[str, list[tuple[int, float]]] = {e.name: [] for e in engines}
    for c in contexts:
        for e in engines:
            rate = decode_at(e, long_prompt[:c], args.gen_tokens)
            curves[e.name].append((c, rate))
            settle()
    for e in engines:
        e.close()

    gguf_engine = engines[0]
    from ggufc.runtime.artifact_reader import load_manifest

    manifest = load_manifest(gguf_engine.artifact)
    n_past = args.prompt_tokens + args.gen_tokens // 2
    decode_bytes = decode_bytes_per_token(manifest, n_past)
    settle()
    bandwidth = stream_bandwidth(args.threads)
    # the same read over an array of the decode step's size: a step re-reads the same bytes every
    # token, so where the caches can hold them this is the step's own roofline (not DRAM's)
    bandwidth["same_size_read_gb_s"] = sgemv_read(np.ones(decode_bytes // 4, np.float32))
    largest = output_gemv_bandwidth(gguf_engine.artifact)  # last: TVM's pool spins for a while after

    report: dict[str, Any] = {
        "model": str(model), "model_name": model.name, "machine": machine(), "threads": args.threads,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
        **results,
        "bandwidth": bandwidth, "decode_bytes": decode_bytes,
        "decode_gb_s": decode_bytes * results["ggufc"]["decode_tok_s"] / 1e9,
        "largest_gemv": largest, "decode_vs_ctx": curves,
        "load_avg_1min": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")],
    }
    report["decode_roofline_fraction"] = report["decode_gb_s"] / bandwidth["read_gb_s"]
    report["decode_same_size_fraction"] = report["decode_gb_s"] / bandwidth["same_size_read_gb_s"]
    if "llama.cpp" in results:
        report["ratio"] = {k: results["ggufc"][k] / results["llama.cpp"][k] for k in ("prefill_tok_s", "decode_tok_s")}
    if args.compile_times:
        report["compile_seconds"] = compile_times(model, out)
    (out / "bench_cpu.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    plot(out / "decode_vs_ctx.png", curves, f"{model.name}, {args.threads} threads")
    table = results_table(report, plot_link(out / "decode_vs_ctx.png", args.doc))
    print(table)
    if args.doc:
        update_doc(args.doc, table)
    print(json.dumps({k: report[k] for k in ("ggufc", "llama.cpp", "ratio", "decode_gb_s", "decode_roofline_fraction",
                                             "decode_same_size_fraction") if k in report}))


if __name__ == "__main__":
    main()
