"""`ggufc serve` under concurrent greedy streams: total decode tokens/s and latency percentiles.

Starts `ggufc serve MODEL --parallel P` on a free loopback port, then for each concurrency C in
`--clients` runs C streaming /v1/completions clients at once (greedy, `--tokens` each, distinct
prompts), `--rounds` times, and reports per C:

- decode tok/s: tokens after each stream's first one, summed, over the span from the earliest
  first token to the latest last token (prompt reading excluded);
- time to first token and inter-token latency, p50 / p90 / p99 over every stream and token;
- the ratio of C streams' decode tok/s to one stream's.

    python benchmarks/bench_serve.py [MODEL.gguf|ARTIFACT] [--parallel 4] [--clients 1,4] [--tokens 64]
        [--rounds 3] [--json OUT.json]

The server steps its slots round-robin (one decode call per slot per step), so on a CPU the ratio
shows what interleaving gains (overlapping Python work with kernels), not batched weight reads.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "My favourite animal is the",
    "In 1969, the first humans", "A haiku about the sea:",
]


def start_server(model: str | None, parallel: int) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "ggufc.cli", "serve", *([model] if model else []), "--port", "0",
            "--parallel", str(parallel), "--queue", "64", "--alias", "bench"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        match = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
        if match:
            threading.Thread(target=_drain, args=(proc.stderr,), daemon=True).start()  # never blocks the server
            return proc, int(match.group(1))
    raise SystemExit(f"ggufc serve exited with status {proc.wait()}")


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def stream_once(port: int, prompt: str, tokens: int) -> dict[str, Any]:
    """One greedy streamed completion: send time and the arrival time of every text chunk."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    arrivals, usage = [], None
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        elif event["choices"] and event["choices"][0]["finish_reason"] is None:
            arrivals.append(time.perf_counter())
    conn.close()
    return {"sent": sent, "arrivals": arrivals, "completion_tokens": (usage or {}).get("completion_tokens", 0)}


def run_concurrent(port: int, clients: int, tokens: int) -> list[dict[str, Any]]:
    results: list[Any] = [None] * clients

    def work(i: int) -> None:
        results[i] = stream_once(port, PROMPTS[i % len(PROMPTS)], tokens)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summarise(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    rates, ttft, itl = [], [], []
    for streams in runs:
        firsts = [s["arrivals"][0] for s in streams if s["arrivals"]]
        lasts = [s["arrivals"][-1] for s in streams if s["arrivals"]]
        after_first = sum(max(s["completion_tokens"] - 1, 0) for s in streams)
        span = max(lasts) - min(firsts)
        rates.append(after_first / span if span > 0 else float("nan"))
        for s in streams:
            if s["arrivals"]:
                ttft.append(s["arrivals"][0] - s["sent"])
                itl.extend(np.diff(s["arrivals"]).tolist())

    def pct(xs: list[float]) -> dict[str, float]:
        return {f"p{q}": float(np.percentile(xs, q)) * 1e3 for q in (50, 90, 99)} if xs else {}

    return {"decode_tok_s": float(np.median(rates)), "decode_tok_s_rounds": rates, "ttft_ms": pct(ttft),
            "itl_ms": pct(itl)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--clients", default="1,4", help="comma-separated concurrencies (default 1,4)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per stream (default 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.clients.split(",")]
    proc, port = start_server(args.model, args.parallel)
    report: dict[str, Any] = {"parallel": args.parallel, "tokens": args.tokens, "rounds": args.rounds,
                              "load_avg_start": os.getloadavg()[0], "by_clients": {}}
    try:
        run_concurrent(port, args.parallel, 4)  # warm-up: every slot's first calls
        for c in concurrencies:
            runs = [run_concurrent(port, c, args.tokens) for _ in range(args.rounds)]
            report["by_clients"][str(c)] = summarise(runs)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report["load_avg_end"] = os.getloadavg()[0]
    one = report["by_clients"].get("1", {}).get("decode_tok_s")
    print(f"{'clients':>7} {'decode tok/s':>12} {'vs 1':>6} {'TTFT p50/p90/p99 ms':>24} {'ITL p50/p90/p99 ms':>22}")
    for c, r in report["by_clients"].items():
        ratio = f"{r['decode_tok_s'] / one:.2f}x" if one else "-"
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"{c:>7} {r['decode_tok_s']:>12.1f} {ratio:>6} {t['p50']:>8.1f}/{t['p90']:.1f}/{t['p99']:.1f} "
              f"{i['p50']:>8.1f}/{i['p90']:.1f}/{i['p99']:.1f}")
    print(f"load average {report['load_avg_start']:.1f} at the start, {report['load_avg_end']:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
