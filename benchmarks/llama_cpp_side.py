"""llama.cpp's side of the benchmarks, run by whichever Python has `llama-cpp-python`.

llama.cpp is often best built into its own virtual environment (e.g. with AVX-512 switched on),
apart from ggufc's, so the benchmark scripts run this file with that environment's interpreter:

    PY -m benchmarks.llama_cpp_side quantize SRC.gguf DST.gguf Q4_K_M [--threads 2]
    PY -m benchmarks.llama_cpp_side serve     # JSON lines on stdin/stdout, see `serve`

`llama_python()` says which interpreter that is: `--llama-python`, else `$GGUFC_LLAMA_PYTHON`,
else the running one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QUANT_TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
               "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS")


def llama_python(explicit: str | None = None) -> str:
    return explicit or os.environ.get("GGUFC_LLAMA_PYTHON") or sys.executable


def llama_cpp_missing(python: str) -> str | None:
    """None when `python` can import llama_cpp, else a one-line reason."""
    try:
        probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
    except OSError as exc:
        return f"cannot run {python} ({exc.strerror}) to reach llama-cpp-python"
    if probe.returncode == 0:
        return None
    return (f"llama-cpp-python is not importable by {python} "
            "(pip install llama-cpp-python there, or pass --llama-python / set GGUFC_LLAMA_PYTHON)")


# --------------------------------------------------------------------------------------- quantize


def quantize(src: Path, dst: Path, qtype: str, threads: int) -> None:
    """llama.cpp's own quantizer (llama_model_quantize), with its default per-tensor choices."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".part")  # never leave a half-written model under the final name
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed for {src} -> {qtype} (status {rc})")
    tmp.replace(dst)


def repo_on_path() -> dict[str, str]:
    """The environment for this file under another interpreter: the repository root importable (for
    `benchmarks.bench_cpu`), as it is from the root with `python -m`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))


def quantize_with(python: str, src: Path, dst: Path, qtype: str, threads: int) -> None:
    """Run `quantize` under `python` (the interpreter that has llama_cpp)."""
    subprocess.run([python, "-m", "benchmarks.llama_cpp_side", "quantize", str(src), str(dst), qtype,
                    "--threads", str(threads)], check=True, env=repo_on_path())


# ------------------------------------------------------------------------------------------ serve


def build_info() -> dict[str, str]:
    import llama_cpp

    return {"version": llama_cpp.__version__, "library": str(llama_cpp.llama_cpp._base_path),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def serve() -> None:
    """One request per stdin line, one JSON answer per stdout line:
    {"cmd": "info"} -> build_info();
    {"cmd": "load", "model", "threads", "n_ctx"} -> {"n_vocab"};
    {"cmd": "time", "prompt", "gen_tokens"} -> {"prefill_s", "decode_s"} (bench_cpu.time_once);
    {"cmd": "greedy", "prompt", "gen_tokens"} -> {"tokens", "finite"} (the greedy continuation,
    whether the prompt's logits are all finite);
    {"cmd": "close"} -> {}."""
    from benchmarks.bench_cpu import LlamaCppEngine, time_once

    engine: Any = None
    out = sys.stdout
    sys.stdout = sys.stderr  # llama.cpp's Python side may print: keep the protocol stream clean
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "info":
            answer: dict[str, Any] = build_info()
        elif cmd == "load":
            engine = LlamaCppEngine(Path(req["model"]), req["threads"], req["n_ctx"])
            answer = {"n_vocab": engine.n_vocab}
        elif cmd == "time":
            prefill, decode = time_once(engine, req["prompt"], req["gen_tokens"])
            answer = {"prefill_s": prefill, "decode_s": decode}
        elif cmd == "greedy":
            answer = greedy(engine, req["prompt"], req["gen_tokens"])
        elif cmd == "close":
            engine.close()
            engine, answer = None, {}
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def greedy(engine: Any, prompt: list[int], gen_tokens: int) -> dict[str, Any]:
    import numpy as np

    engine.reset()
    engine.llm.eval(prompt)
    logits = np.ctypeslib.as_array(engine.llm._ctx.get_logits(), shape=(engine.n_vocab,))
    finite = bool(np.isfinite(logits).all())
    tokens = [int(np.argmax(logits))]
    for _ in range(gen_tokens - 1):
        tokens.append(engine.feed([tokens[-1]]))
    return {"tokens": tokens, "finite": finite}


class LlamaCppWorker:
    """A `serve` process under another interpreter, driven one request at a time."""

    name = "llama.cpp"

    def __init__(self, python: str) -> None:
        self.proc = subprocess.Popen([python, "-m", "benchmarks.llama_cpp_side", "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=repo_on_path())

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (status {self.proc.wait()}) on {req['cmd']}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def time_once(self, prompt: list[int], gen_tokens: int) -> tuple[float, float]:
        t = self.ask(cmd="time", prompt=prompt, gen_tokens=gen_tokens)
        return t["prefill_s"], t["decode_s"]

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize", help="quantize a GGUF with llama.cpp's quantizer")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("qtype", choices=QUANT_TYPES)
    q.add_argument("--threads", type=int, default=2)
    sub.add_parser("serve", help="answer benchmark requests on stdin/stdout")
    sub.add_parser("info", help="print llama.cpp's version and build (system info)")
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit(llama_cpp_missing(sys.executable)) from None
    if args.cmd == "quantize":
        t0 = time.perf_counter()
        quantize(args.src, args.dst, args.qtype, args.threads)
        mib = args.dst.stat().st_size / 2**20
        print(f"{args.dst}: {args.qtype}, {mib:.0f} MiB in {time.perf_counter() - t0:.0f} s")
    elif args.cmd == "serve":
        serve()
    else:
        print(json.dumps(build_info(), indent=1))


if __name__ == "__main__":
    main()
