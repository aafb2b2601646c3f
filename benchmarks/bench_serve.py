"""`ggufc serve` under concurrent greedy streams: total decode tokens/s and latency percentiles.

Starts `ggufc serve MODEL --parallel P` on a free loopback port, then for each concurrency C in
`--clients` runs C streaming /v1/completions clients at once (greedy, `--tokens` each, distinct
prompts), `--rounds` times, and reports per C:

- decode tok/s: tokens after each stream's first one, summed, over the span from the earliest
  first token to the latest last token (prompt reading excluded);
- all active/s: text chunks per second while every stream was generating (from the last stream's
  first chunk to the first stream's last one): the rate of C streams batched together, which the
  span above mixes with the stretches where streams that stopped early (greedy end of text) or
  started late left fewer to batch; each stream's token count is listed;
- time to first token and inter-token latency, p50 / p90 / p99 over every stream and token;
- the ratio of C streams' decode tok/s to one stream's.

The concurrencies take turns within each round (1, 4, 1, 4, ...), so a machine whose load changes
during the run weighs on both figures alike. Then, in this process, the kernel-level figure: one
batched decode step of P slots (`SlotGroup.decode_batch`) against one single-sequence decode
step, timed alternately, and the throughput ratio P * t_single / t_batch.

    python -m benchmarks.bench_serve [MODEL.gguf|ARTIFACT] [--parallel 4] [--clients 1,4] [--tokens 64]
        [--rounds 3] [--json OUT.json]

The server feeds the tokens of all generating slots in one batched decode call (every weight read
once per step), so the ratio is what batching gains over one stream.
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


def all_active_rate(streams: list[dict[str, Any]]) -> float:
    """Text chunks per second while every stream was generating: from the last stream's first chunk
    to the first stream's last one (a stream that ends early, or starts late, leaves fewer streams
    to batch; this rate is the one of all of them at once)."""
    start = max(s["arrivals"][0] for s in streams)
    end = min(s["arrivals"][-1] for s in streams)
    if end <= start:
        return float("nan")
    return sum(sum(1 for t in s["arrivals"] if start < t <= end) for s in streams) / (end - start)


def summarise(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    rates, active, ttft, itl, lengths = [], [], [], [], []
    for streams in runs:
        firsts = [s["arrivals"][0] for s in streams if s["arrivals"]]
        lasts = [s["arrivals"][-1] for s in streams if s["arrivals"]]
        after_first = sum(max(s["completion_tokens"] - 1, 0) for s in streams)
        span = max(lasts) - min(firsts)
        rates.append(after_first / span if span > 0 else float("nan"))
        active.append(all_active_rate(streams) if all(s["arrivals"] for s in streams) else float("nan"))
        lengths.append([s["completion_tokens"] for s in streams])
        for s in streams:
            if s["arrivals"]:
                ttft.append(s["arrivals"][0] - s["sent"])
                itl.extend(np.diff(s["arrivals"]).tolist())

    def pct(xs: list[float]) -> dict[str, float]:
        return {f"p{q}": float(np.percentile(xs, q)) * 1e3 for q in (50, 90, 99)} if xs else {}

    return {"decode_tok_s": float(np.median(rates)), "decode_tok_s_rounds": rates, "ttft_ms": pct(ttft),
            "itl_ms": pct(itl), "all_active_chunks_s": float(np.median(active)), "all_active_rounds": active,
            "completion_tokens": lengths}


def kernel_step_ratio(model: str | None, parallel: int, steps: int = 40) -> dict[str, Any]:
    """Median times of one `decode_batch` call over `parallel` slots and of one single-sequence
    decode call, alternated, on the artifact the server ran (slots at different positions)."""
    from ggufc.driver.models import cached_artifact_dir, resolve_model
    from ggufc.runtime.slot_group import SlotGroup

    source = resolve_model(model, "llvm", None)
    path = source.path if source.kind == "artifact" else cached_artifact_dir(source.path, source.target, source.n_ctx)
    group = SlotGroup(path, parallel)
    if group.batch_refused is not None:
        return {"refused": group.batch_refused, "batch_ms": float("nan"), "single_ms": float("nan"),
                "throughput_ratio": float("nan")}
    for i, session in enumerate(group.sessions):
        session.forward(list(range(1, 9 + 5 * i)))
    single, batch = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        group.decode_batch([(i, 1 + (step + i) % 50) for i in range(parallel)])
        t1 = time.perf_counter()
        group.sessions[0].forward([1 + step % 50])
        t2 = time.perf_counter()
        batch.append(t1 - t0)
        single.append(t2 - t1)
    b, s = float(np.median(batch)), float(np.median(single))
    group.close()
    return {"batch_ms": b * 1e3, "single_ms": s * 1e3, "throughput_ratio": parallel * s / b}


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
        runs: dict[int, list[list[dict[str, Any]]]] = {c: [] for c in concurrencies}
        for _ in range(args.rounds):
            for c in concurrencies:
                runs[c].append(run_concurrent(port, c, args.tokens))
        report["by_clients"] = {str(c): summarise(r) for c, r in runs.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report["kernel"] = kernel_step_ratio(args.model, args.parallel)
    report["load_avg_end"] = os.getloadavg()[0]
    one = report["by_clients"].get("1", {})
    print(f"{'clients':>7} {'decode tok/s':>12} {'vs 1':>6} {'all active/s':>12} {'vs 1':>6} "
          f"{'TTFT p50/p90/p99 ms':>24} {'ITL p50/p90/p99 ms':>22}  tokens per stream")
    for c, r in report["by_clients"].items():
        ratio = f"{r['decode_tok_s'] / one['decode_tok_s']:.2f}x" if one else "-"
        active = f"{r['all_active_chunks_s'] / one['all_active_chunks_s']:.2f}x" if one else "-"
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"{c:>7} {r['decode_tok_s']:>12.1f} {ratio:>6} {r['all_active_chunks_s']:>12.1f} {active:>6} "
              f"{t['p50']:>8.1f}/{t['p90']:.1f}/{t['p99']:.1f} {i['p50']:>8.1f}/{i['p90']:.1f}/{i['p99']:.1f}  "
              f"{r['completion_tokens'][-1]}")
    k = report["kernel"]
    print(f"kernel: one batched step of {args.parallel} {k['batch_ms']:.2f} ms, one single decode step "
          f"{k['single_ms']:.2f} ms: {k['throughput_ratio']:.2f}x the tokens/s")
    print(f"load average {report['load_avg_start']:.1f} at the start, {report['load_avg_end']:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
