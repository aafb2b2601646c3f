"""Prefill and decode speed of one model compiled by two source trees of ggufc, interleaved in one run.

    python -m benchmarks.source_trees_ab OLD_TREE MODEL.gguf [MODEL.gguf ...] [--new NEW_TREE]
        [--cpu NAME] [--rounds 5] [--prompt-tokens 64] [--gen-tokens 32] [--threads 2] [--out FILE.md]

For a change that should not move speed (a restructuring, a refactor): each tree (a checkout of
another commit, e.g. made by `git worktree add --detach DIR REV`; NEW_TREE defaults to this one)
compiles each model into its own artifact with its own compile cache, then `ggufc bench --json` of
each tree runs on its artifact in turn, round by round, so both see the same machine load. Each tree
runs in its own process with `PYTHONPATH=TREE`, so the old artifact is read by the old runtime.
Prints, per model, the median and best tokens/s of each tree and new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _ggufc(tree: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "GGUFC_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "ggufc.cli", *args], env=env, cwd=tree, capture_output=True,
                          text=True, check=False)


def _compile(tree: Path, model: Path, out: Path, cpu: str | None) -> None:
    proc = _ggufc(tree, out.parent / "cache", "compile", str(model), "-o", str(out), *(["--cpu", cpu] if cpu else []))
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: compile of {model.name} failed: {proc.stderr.strip().splitlines()[-1:]}")


def _bench(tree: Path, artifact: Path, args: argparse.Namespace) -> dict[str, float]:
    proc = _ggufc(tree, artifact.parent / "cache", "bench", str(artifact), "--json", "--threads", str(args.threads),
                  "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens))
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: bench of {artifact} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(model: str, samples: dict[str, list[dict[str, float]]], key: str) -> str:
    old = [s[key] for s in samples["old"]]
    new = [s[key] for s in samples["new"]]
    ratio = statistics.median(new) / statistics.median(old)
    return (f"| {model} | {key.removesuffix('_tok_s')} | {statistics.median(old):.1f} | {max(old):.1f} | "
            f"{statistics.median(new):.1f} | {max(new):.1f} | {ratio:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="the other source tree")
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--new", type=Path, default=HERE)
    ap.add_argument("--cpu", default=None, help="build for this CPU (LLVM name) in both trees")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    lines = ["| model | phase | old median | old best | new median | new best | new / old (medians) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="ggufc-ab-") as tmp:
        for model in (m.resolve() for m in args.models):
            artifacts = {}
            for name, tree in trees.items():
                artifacts[name] = Path(tmp) / name / model.stem
                artifacts[name].parent.mkdir(exist_ok=True)
                _compile(tree, model, artifacts[name], args.cpu)
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    samples[name].append(_bench(tree, artifacts[name], args))
            lines += [_row(model.stem, samples, "prefill_tok_s"), _row(model.stem, samples, "decode_tok_s")]
            print("\n".join(lines[-2:]), flush=True)
    text = "\n".join(lines)
    print(f"\nold: {trees['old']}\nnew: {trees['new']}\n{text}")
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
