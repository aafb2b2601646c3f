"""A compiled artifact whose manifest was edited (and resealed) is refused in one line or runs
exactly as before: no manifest value reaches native code unchecked.

Every case runs in one child process, so a crash in native code fails this test (naming the case)
instead of taking the test run down with it.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.gpu_support import golden_fixture

ODD_VALUES: list[Any] = [None, True, -1, 0, 1, 3, 2**63, 1e308, "x", "../../etc/passwd", [], [1, "a"], {}, {"a": 1}]
DTYPES = ["float16", "float64", "int8", "uint8", "int64", "O", "<U4", "V8", "complex64", "bogus"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ggufc.driver.compile import compile_model

    out = tmp_path_factory.mktemp("fuzz") / "artifact"
    compile_model(golden_fixture("llama-dense"), out_dir=out, n_ctx=64)
    return out


def top_level_cases(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Each key missing, and each key holding each odd value."""
    cases = []
    for key in manifest:
        cases.append({k: v for k, v in manifest.items() if k != key})
        cases += [{**manifest, key: value} for value in ODD_VALUES]
    return cases


def layout_cases(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Shapes, dtypes and keys of states and weight arrays, one change at a time."""
    cases = []
    entries = [("states", i, None) for i in range(len(manifest["states"]))]
    entries += [("params", i, j) for i, p in enumerate(manifest["params"]) for j in range(len(p["arrays"]))]
    for group, i, j in entries[:12]:
        for change in _entry_changes():
            case = copy.deepcopy(manifest)
            entry = case[group][i] if j is None else case[group][i]["arrays"][j]
            change(entry)
            cases.append(case)
    return cases


def _entry_changes() -> list[Any]:
    def set_dim(index: int, value: Any) -> Any:
        return lambda e: e["shape"].__setitem__(index % max(len(e["shape"]), 1), value) if e["shape"] else None

    changes: list[Any] = [set_dim(0, v) for v in (0, 1, -1, 2**40, "8", 1.5, None)]
    changes += [set_dim(-1, v) for v in (0, 2, 10**6)]
    changes += [lambda e, d=d: e.__setitem__("dtype", d) for d in DTYPES]
    changes += [lambda e: e["shape"].append(1), lambda e: e["shape"].pop(), lambda e: e.__setitem__("shape", [])]
    changes += [lambda e, k=k: e.pop(k) for k in ("shape", "dtype")]
    changes.append(lambda e: e.__setitem__("key", "missing::w") if "key" in e else None)
    return changes


def random_walk_cases(manifest: dict[str, Any], n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Random paths into the manifest set to random odd values."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        case = copy.deepcopy(manifest)
        node: Any = case
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = rng.choice(keys)
            if isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.7:
                node = node[key]
                continue
            node[key] = rng.choice(ODD_VALUES + [rng.randint(-(2**31), 2**31)])
            break
        cases.append(case)
    return cases


RUNNER = r"""
import hashlib, json, sys
import numpy as np
from ggufc.runtime.artifact import ArtifactError
from ggufc.runtime.session import Session

root, cases_file = sys.argv[1], sys.argv[2]
cases = json.load(open(cases_file))
tokens = np.array([1, 5, 9, 2, 7], dtype=np.int32)

def reseal(text):
    open(f"{root}/manifest.json", "w").write(text)
    open(f"{root}/manifest.sha256", "w").write(hashlib.sha256(text.encode()).hexdigest() + "  manifest.json\n")

def evaluate():
    with Session(root) as s:
        first = s.forward(tokens, all_logits=True), s.forward(tokens[:1])
        s.reset()  # then as long a context as the manifest claims (capped): where an unchecked n_ctx hurts
        last = s.forward(np.resize(tokens, min(s.n_ctx - 1, 300)))
        return (*first, last)

original = open(f"{root}/manifest.json").read()
baseline = evaluate()
for index, case in enumerate(cases):
    print(f"case {index}", flush=True)
    reseal(json.dumps(case))
    try:
        got = evaluate()
    except (ArtifactError, ValueError) as exc:
        text = str(exc)
        print("refused" if text and "\n" not in text and len(text) < 400 else f"bad message {text!r}", flush=True)
        continue
    except Exception as exc:
        print(f"bad {type(exc).__name__}: {exc}".replace("\n", " ")[:300], flush=True)
        continue
    same = all(np.array_equal(a, b) for a, b in zip(got, baseline))
    print("ran unchanged" if same else "ran with other logits", flush=True)
reseal(original)
"""


def test_edited_manifests_are_refused_or_harmless(artifact: Path, tmp_path: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    cases = top_level_cases(manifest) + layout_cases(manifest) + random_walk_cases(manifest, 150)
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    work = tmp_path / "artifact"
    shutil.copytree(artifact, work)
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(work), str(cases_file)],
                          capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    last_case = next((line for line in reversed(lines) if line.startswith("case ")), "before the first case")
    assert proc.returncode == 0, f"child died ({proc.returncode}) at {last_case}: {proc.stderr[-2000:]}"
    outcomes = [line for line in lines if not line.startswith("case ")]
    assert len(outcomes) == len(cases)
    bad = [(i, o) for i, o in enumerate(outcomes) if o not in ("refused", "ran unchanged")]
    assert not bad, bad[:5]
    assert outcomes.count("refused") > len(cases) // 2  # most edits touch something that matters
