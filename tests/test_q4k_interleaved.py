"""Q4_K weights stored 8 rows side by side for the AVX2 8-bit kernels (codegen/cpu_int8/q4k_interleaved.py):
the layout's bytes, its GEMV groups, which weights a haswell artifact keeps in it, and that such an
artifact computes what the row-major one does and refuses a manifest of the other layout.
(The kernels against the numpy model of llama.cpp's order: tests/test_llama_order.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import tvm

from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
from ggufc.runtime.artifact import ArtifactError
from ggufc.runtime.session import Session
from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import write_fixture
from tests.support.int8_isas import HASWELL

HASWELL_SPEC = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
SIZE = FixtureSize(n_embd=256, head_dim=64, n_ff=512)  # K-quant rows: whole 256-value super-blocks


def _build(func: tvm.tirx.PrimFunc) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=HASWELL)["main"]


def _row_major(n: int, k: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random row-major Q4_K kernel arrays (any bytes: the layout moves them, whatever they mean)."""
    arrays = {}
    for f, shape, dtype in layout_spec("Q4_K", (n, k)):
        values = rng.uniform(1e-4, 2e-3, shape) if dtype == "float16" else rng.integers(0, 64, shape)
        arrays[f] = values.astype(dtype)
    return arrays


def test_interleave_puts_row_r_of_each_group_in_lane_r() -> None:
    n, k = 16, 512
    rows = _row_major(n, k, np.random.default_rng(0))
    rows["qs"] = np.random.default_rng(1).integers(0, 256, rows["qs"].shape).astype(np.uint8)
    inter = X.interleave(rows, (n, k))
    assert [(f, a.shape, str(a.dtype)) for f, a in inter.items()] == [tuple(s) for s in X.layout_spec((n, k))]
    assert X.is_interleaved(tuple((f, tuple(s), d) for f, s, d in X.layout_spec((n, k))), (n, k))
    assert not X.is_interleaved(tuple((f, tuple(s), d) for f, s, d in layout_spec("Q4_K", (n, k))), (n, k))
    for g, r, i in [(0, 0, 0), (1, 5, 1), (1, 7, 0)]:
        row = 8 * g + r
        assert inter["d8"][g, i, r] == rows["d"][row, i] and inter["dmin8"][g, i, r] == rows["dmin"][row, i]
        for s in range(8):
            assert inter["sc8"][g, i, s, r] == rows["sc"][row, i * 8 + s]
            assert inter["mn8"][g, i, s // 2, 2 * r + s % 2] == rows["mn"][row, i * 8 + s]
        for w in range(i * 4, i * 4 + 4):
            for c in range(8):
                np.testing.assert_array_equal(inter["qs8"][g, w, c, 4 * r:4 * r + 4],
                                              rows["qs"][row, w, 4 * c:4 * c + 4])


@pytest.mark.parametrize(("prologue", "residual", "ns"),
                         [((), False, (64, 24, 8)), (("rms_norm", 1e-5), False, (32, 16)), (("swiglu",), True, (40,))])
def test_gemv_groups_equal_the_row_major_kernels(prologue: tuple, residual: bool, ns: tuple[int, ...]) -> None:
    """A decode step's GEMV groups (up to three matrices, with an RMSNorm or SwiGLU prologue and
    a residual epilogue) in either layout: the same order, so the same bits."""
    rng = np.random.default_rng(len(ns))
    k = 512
    mats = [_row_major(n, k, rng) for n in ns]
    lead = [rng.standard_normal((1, k)).astype(np.float32)]
    if prologue:
        lead.append(rng.standard_normal((k,) if prologue[0] == "rms_norm" else (1, k)).astype(np.float32))
    tail = [rng.standard_normal((1, ns[0])).astype(np.float32)] if residual else []
    inter = [X.interleave(m, (n, k)) for m, n in zip(mats, ns, strict=True)]
    outs = []
    for qtype, fields, arrays in (("Q4_K", [f for f, _, _ in layout_spec("Q4_K", (8, k))], mats),
                                  (X.LAYOUT, list(X.FIELDS), inter)):
        ys = [aligned_zeros((1, n), np.float32) for n in ns]
        kernel = _build(Q8.int8_gemv_group(qtype, ns, k, HASWELL, prologue, residual))
        weights = (to_tvm(a[f]) for a in arrays for f in fields)
        kernel(*map(to_tvm, lead), *weights, *map(to_tvm, tail), *map(to_tvm, ys))
        outs.append(ys)
    for old, new in zip(*outs, strict=True):
        assert np.any(old != 0)
        np.testing.assert_array_equal(new, old)


def _compile(out: Path, interleaved: bool = True) -> Path:
    """A Q4_K llama compiled for haswell, its matrices interleaved or (monkeypatched off) not."""
    from ggufc.driver.compile import compile_model

    path = write_fixture("llama", out.parent / "m.gguf", seed=3, qtype="Q4_K", size=SIZE)
    with pytest.MonkeyPatch.context() as mp:
        if not interleaved:
            mp.setattr(X, "interleaved_params", lambda graphs, target: frozenset())
        compile_model(path, HASWELL_SPEC, out)
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(tmp_path_factory.mktemp("q4kx8") / "x8")


def _params(root: Path) -> list[dict]:
    return json.loads((root / "manifest.json").read_text())["params"]


def _interleaved(root: Path) -> set[str]:
    """The params whose arrays are the interleaved layout's fields."""
    return {p["name"] for p in _params(root) if [a["key"].split("::")[1] for a in p["arrays"]] == list(X.FIELDS)}


def test_haswell_artifacts_keep_8_bit_matmul_weights_interleaved(artifact: Path) -> None:
    """Every Q4_K matrix only 8-bit matmuls read is stored interleaved; the embedding table, which
    a lookup reads by row, stays row-major."""
    q4k = {p["name"] for p in _params(artifact) if p["qtype"] == "Q4_K"}
    interleaved = _interleaved(artifact)
    assert "token_embd.weight" in q4k - interleaved
    assert {"blk.0.attn_q.weight", "blk.1.ffn_down.weight"} <= interleaved <= q4k


@pytest.mark.slow
def test_interleaved_artifact_computes_the_row_major_ones_logits(artifact: Path, tmp_path: Path) -> None:
    """Prompt (whole 4-token tiles and a tail), then decode steps: bit for bit the logits of the
    same model compiled with its Q4_K matrices row-major."""
    rows = _compile(tmp_path / "rows", interleaved=False)
    assert not _interleaved(rows)
    tokens = np.array([1, 5, 9, 2, 7, 3, 11], dtype=np.int32)
    logits = []
    for root in (rows, artifact):
        with Session(root) as s:
            steps = [s.forward(tokens, all_logits=True)]
            steps += [s.forward(tokens[i:i + 1]) for i in range(3)]
        logits.append(steps)
    for old, new in zip(*logits, strict=True):
        np.testing.assert_array_equal(new, old)


def test_manifest_of_the_other_layout_is_refused(artifact: Path, tmp_path: Path) -> None:
    """A manifest claiming the row-major layout for kernels built for the interleaved one (resealed,
    so only the layout contract stands in the way) is refused before any kernel runs."""
    import shutil

    work = tmp_path / "art"
    shutil.copytree(artifact, work)
    manifest = json.loads((work / "manifest.json").read_text())
    changed = 0
    for p in manifest["params"]:
        if p["name"] in _interleaved(artifact):
            groups, supers, _ = p["arrays"][0]["shape"]
            spec = layout_spec("Q4_K", (groups * 8, supers * 256))
            p["arrays"] = [{"key": f"{p['name']}::{f}", "shape": list(s), "dtype": d} for f, s, d in spec]
            changed += 1
    assert changed
    text = json.dumps(manifest)
    (work / "manifest.json").write_text(text)
    (work / "manifest.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "  manifest.json\n")
    with pytest.raises(ArtifactError, match="does not match the layout the kernels were compiled for"):
        with Session(work) as s:
            s.forward(np.array([1, 2], dtype=np.int32))
