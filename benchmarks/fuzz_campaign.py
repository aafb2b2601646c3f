"""A long fuzz campaign against the GGUF reader (validator + gguf.GGUFReader via open_gguf).

    python -m benchmarks.fuzz_campaign --engine atheris --seconds 600   # coverage-guided (libFuzzer)
    python -m benchmarks.fuzz_campaign --engine mutate --seconds 600    # structure-aware, pure Python

The property is `check_input` from tests/support/gguf_corpus.py: GGUFError or a clean open, nothing else.
Seeds are the fuzz suite's corpus (a synthetic file with every value type and several tensor
types, and the smallest project fixture). `atheris` (pip install atheris) instruments ggufc and
the gguf package and lets libFuzzer steer mutations by coverage, half of them through the
structure-aware mutator; libFuzzer also treats an input that takes over 10 s as a crash (a hang)
and one that pushes memory over 2 GiB as a crash (an allocation from a claimed size). `mutate`
needs nothing but runs blind. Both print the number of executions and of crashes at the end;
crashing inputs are saved under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path


def seeds(scratch: Path) -> list[bytes]:
    from tests.support.gguf_corpus import build_gguf, fixture_bytes

    return [build_gguf().data, fixture_bytes(scratch)]


# =========================================================================== pure Python


def run_mutate(seconds: float, out: Path, seed: int) -> dict[str, object]:
    from tests.support.gguf_corpus import build_gguf, check_input, mutate

    scratch = Path(tempfile.mkdtemp(prefix="ggufc-fuzz-"))
    synthetic = build_gguf()
    bases = [(synthetic.data, list(synthetic.fields)), (seeds(scratch)[1], [])]
    rng = random.Random(seed)
    counts = {"executions": 0, "refused": 0, "accepted": 0, "crashes": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data, fields = rng.choice(bases)
        mutant = mutate(data, fields, rng, rng.randint(1, 8))
        counts["executions"] += 1
        try:
            counts[check_input(mutant, scratch)] += 1
        except Exception:  # the property failed: keep the input and go on
            counts["crashes"] += 1
            path = out / f"crash-{counts['crashes']}.gguf"
            path.write_bytes(mutant)
            print(f"crash saved to {path}:\n{traceback.format_exc()}", file=sys.stderr)
    return {"engine": "mutate", "seconds": seconds, **counts}


# =========================================================================== atheris


def run_atheris(seconds: float, out: Path, seed: int) -> None:
    import atheris

    with atheris.instrument_imports(include=["ggufc", "gguf"]):
        from tests.support.gguf_corpus import check_input, mutate

    scratch = Path(tempfile.mkdtemp(prefix="ggufc-fuzz-"))
    corpus = Path(tempfile.mkdtemp(prefix="ggufc-fuzz-corpus-"))
    for index, data in enumerate(seeds(scratch)):
        (corpus / f"seed-{index}.gguf").write_bytes(data)
    dictionary = out / "gguf.dict"
    dictionary.write_text(_dictionary())
    executions = [0]

    def test_one_input(data: bytes) -> None:
        executions[0] += 1
        if executions[0] % 50_000 == 0:
            print(f"#{executions[0]} executions", file=sys.stderr, flush=True)
        check_input(data, scratch)

    def custom_mutator(data: bytes, max_size: int, mutator_seed: int) -> bytes:
        rng = random.Random(mutator_seed)
        if rng.random() < 0.5 or len(data) < 24:
            return bytes(atheris.Mutate(data, max_size))
        return mutate(data, [], rng, rng.randint(1, 4))[:max_size]

    argv = [
        sys.argv[0],
        str(corpus),
        f"-max_total_time={int(seconds)}",
        "-timeout=10",
        "-rss_limit_mb=2048",
        "-max_len=16384",
        f"-seed={seed}",
        f"-dict={dictionary}",
        f"-artifact_prefix={out}/",
        "-print_final_stats=1",
    ]
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


def _dictionary() -> str:
    """Tokens libFuzzer splices in: the magic, versions, type ids, known keys."""
    tokens = [b"GGUF", b"\x02\x00\x00\x00", b"\x03\x00\x00\x00", b"\xff\xff\xff\xff\xff\xff\xff\xff"]
    tokens += [bytes([t, 0, 0, 0]) for t in range(14)]
    keys = ["general.alignment", "general.architecture", "llama.block_count", "tokenizer.ggml.tokens"]
    tokens += [len(k).to_bytes(8, "little") + k.encode() for k in keys]
    return "".join('"' + "".join(f"\\x{b:02x}" for b in t) + '"\n' for t in tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("atheris", "mutate"), default="atheris")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "ggufc-fuzz")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine == "atheris":
        run_atheris(args.seconds, args.out, args.seed)  # libFuzzer exits the process itself
        return 0
    summary = run_mutate(args.seconds, args.out, args.seed)
    print(json.dumps(summary))
    return 1 if summary["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
