"""GPU targets checked without a GPU: CUDA to PTX/fatbin, Metal source structure, the plan format.

* cuda: every kernel of the fixtures compiles to PTX with nvcc (each kernel an `.entry`), an
  artifact built with `--arch sm_80,sm_90` carries a fatbin with SASS for both plus PTX, and the
  decode step is captured as one CUDA graph (only the logits matmul, whose output is returned,
  launches outside it);
* metal: every kernel of the plan exists in `kernels.metal` with the argument contract the
  Metal dispatcher uses (buffer indices, the POD-argument struct and its C types, threadgroup
  dimensionality and limits, threadgroup memory);
* targets, the GPU weight layout and the plan checks (expressions, references) as plain units.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from ggufc.codegen.formats.layout import layout_nbytes, repack
from ggufc.codegen.formats.table import QTYPES
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.target import parse_archs, resolve_target, split_target
from ggufc.runtime.plan_expr import PlanExprError, compile_many
from ggufc.runtime.plan_runtime import PlanError, prepare_functions
from tests.support.goldens import with_metadata
from tests.support.gpu_support import golden_fixture, need_nvcc
from tests.support.gpu_targets import check_cuda_ptx, check_metal_plan
from tests.support.random_weights import K_QUANTS, make_raw

FIXTURES = ["llama-dense", "qwen3-dense", "qwen3moe-moe", "llama-dense-Q4_K_M", "qwen35-dense", "qwen3next-moe",
            "qwen4exp-moe", "minimax-m3-moe", "hy_v3-moe"]
# the sparse variants of llama.cpp's goldens (the dense file with the indexer's top_k lowered):
# deepseek4's CSA with selection, window and HCA layers; minimax-m3's block selection
SPARSE_FIXTURES = {
    "deepseek4-moe-F16-sparse": ("deepseek4-moe-F16", {"deepseek4.attention.indexer.top_k": "4"}),
    "minimax-m3-moe-sparse": ("minimax-m3-moe", {"minimax-m3.attention.indexer.top_k": "2"}),
}


def sparse_fixture(name: str, folder: Path) -> Path:
    base, changes = SPARSE_FIXTURES[name]
    return with_metadata(golden_fixture(base), folder / f"{name}.gguf", changes)


# ---------------------------------------------------------------------------------------------
# units


def test_target_names() -> None:
    assert resolve_target("vulkan").kind.name == "webgpu"
    assert resolve_target("metal").kind.name == "metal"
    t = resolve_target("cuda:sm_86,sm_90")
    assert t.kind.name == "cuda" and str(t.attrs["arch"]) == "sm_86"
    assert split_target("cuda:sm_86,sm_90") == ("cuda", ("sm_86", "sm_90"))
    assert split_target("cuda")[1] == ("sm_80", "sm_90")
    assert resolve_target("vulkan").attrs["max_shared_memory_per_block"] == 16384
    for bad in ("sm80", "compute_80", ""):
        with pytest.raises(ValueError):
            parse_archs(bad)
    with pytest.raises(ValueError, match="only cuda"):
        split_target("vulkan:sm_80")


def test_cli_arch_only_for_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = golden_fixture("llama-dense")
    assert main(["compile", str(model), "-t", "vulkan", "--arch", "sm_80", "-o", str(tmp_path / "a")]) == 1
    assert "--arch is for -t cuda" in capsys.readouterr().err
    assert main(["compile", str(model), "-t", "cuda", "--arch", "sm80", "-o", str(tmp_path / "a")]) == 1
    assert "not a CUDA architecture" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", QTYPES)
def test_gpu_layout_is_the_cpu_bytes_word_packed(qtype: str) -> None:
    shape = (3, 5, 512 if qtype in K_QUANTS else 96)
    arrays = repack(qtype, make_raw(qtype, shape), shape)
    packed = QG.pack(qtype, arrays, shape)["w"]
    assert [(n, tuple(s), d) for n, s, d in QG.layout_spec(qtype, shape)] == [("w", packed.shape, str(packed.dtype))]
    if qtype == "F32":
        np.testing.assert_array_equal(packed, arrays["w"])
        return
    lay = QG.packed_layout(qtype, shape)
    raw = packed.view(np.uint8)
    for f in lay.fields:  # every field's bytes, row by row, at the recorded offset
        want = np.ascontiguousarray(arrays[f.name]).reshape(lay.rows, -1).view(np.uint8)
        got = raw[4 * f.offset : 4 * (f.offset + lay.rows * f.words_per_row)].reshape(lay.rows, -1)
        np.testing.assert_array_equal(got[:, : want.shape[1]], want)
        assert got.shape[1] - want.shape[1] < 4  # at most 3 bytes of padding per row
    assert packed.nbytes <= layout_nbytes(qtype, shape) + 3 * lay.rows * len(lay.fields)


def test_plan_expressions_are_whitelisted() -> None:
    f = compile_many(["((n + 31) // 32)", "min(p + n, 7)", "-n % 5", "max(n, p, 3)"], ["n", "p"])
    assert f(40, 2) == (2, 7, (-40) % 5, 40)
    for bad in ("__import__('os')", "n.real", "n ** 2", "1.5", "lambda: 1", "[n]", "q + 1", "n if p else 1",
                "min(n)", "'x'", "n; p"):
        with pytest.raises(PlanExprError):
            compile_many([bad], ["n", "p"])


def test_plan_references_are_checked() -> None:
    step = {"kernel": "k", "entry": "k_kernel", "buffers": [["param", 0]], "scalars": [["n", "int32"]],
            "grid": ["n", "1", "1"], "block": [64, 1, 1]}
    out = {"ref": ["slot", 0], "shape": ["n", "4"], "dtype": "float32"}
    counts = {"param": 1, "state": 0, "slot": 1, "const": 0}
    good = {"functions": {"f": {"tokens": "n", "steps": [step], "outputs": [out]}}}
    assert prepare_functions(good, counts)["f"].evaluate(3, 0) == (3, 3, 1, 1)
    for bad_step in ({**step, "buffers": [["param", 1]]}, {**step, "buffers": [["weights", 0]]},
                     {**step, "grid": ["n", "1"]}, {**step, "block": [4096, 1, 1]},
                     {**step, "scalars": [["open('x')", "int32"]]}):
        with pytest.raises(PlanError):
            prepare_functions({"functions": {"f": {"steps": [bad_step], "outputs": [out]}}}, counts)
    with pytest.raises(PlanError):
        prepare_functions({"functions": {"f": {"steps": [step], "outputs": [{**out, "dtype": "object"}]}}}, counts)


def test_metal_argument_struct_layout() -> None:
    from ggufc.runtime.metal_runtime import pack_args

    blob = pack_args([7, 3, 1.5], ["int32", "int64", "float32"])  # int at 0, long at 8, float at 16
    assert len(blob) == 24
    assert struct.unpack_from("<i", blob, 0)[0] == 7 and struct.unpack_from("<q", blob, 8)[0] == 3
    assert struct.unpack_from("<f", blob, 16)[0] == 1.5


# ---------------------------------------------------------------------------------------------
# cuda


@pytest.mark.parametrize("name", FIXTURES)
def test_every_cuda_kernel_compiles_to_ptx(name: str) -> None:
    check_cuda_ptx(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPARSE_FIXTURES))
def test_sparse_cuda_kernels_compile_to_ptx(name: str, tmp_path: Path) -> None:
    check_cuda_ptx(name, sparse_fixture(name, tmp_path))


def _fatbin_entries(data: bytes) -> list[tuple[str, int]]:
    magic, _, header, size = struct.unpack_from("<IHHQ", data, 0)
    assert magic == 0xBA55ED50, "not a CUDA fatbin"
    out, off = [], header
    while off < header + size:
        kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        out.append(({1: "ptx", 2: "sass"}.get(kind, str(kind)), arch))
        off += entry_header + entry_size
    return out


def test_cuda_artifact_holds_kernels_for_each_arch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need_nvcc()
    out = tmp_path / "cuda"
    assert main(["compile", str(golden_fixture("llama-dense")), "-t", "cuda", "--arch", "sm_80,sm_90",
                 "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target_key"] == "cuda" and manifest["kernel_files"] == ["kernels.so", "kernels.fatbin"]
    cuda = manifest["gpu"]["cuda"]
    assert cuda["archs"] == ["sm_80", "sm_90"] and cuda["binary"] == "kernels.fatbin"
    n_states = len(manifest["states"])
    assert manifest["gpu"]["decode_inputs"] == {"token": n_states - 2, "pos": n_states - 1}
    entries = _fatbin_entries((out / "kernels.fatbin").read_bytes())
    assert ("sass", 80) in entries and ("sass", 90) in entries and ("ptx", 90) in entries, entries
    capsys.readouterr()
    assert main(["verify-artifact", str(out), "-t", "cuda"]) == 0
    # the layout contract is compiled into kernels.so beside the device code: a CUDA runtime reads it
    report = capsys.readouterr().out
    assert "later  layout" in report and "1 made when the model loads" in report, report
    assert main(["verify-artifact", str(out), "-t", "vulkan"]) == 1


# ---------------------------------------------------------------------------------------------
# metal


@pytest.mark.parametrize("name", FIXTURES)
def test_metal_kernels_match_the_plan(name: str, tmp_path: Path) -> None:
    check_metal_plan(name, tmp_path)


@pytest.mark.parametrize("name", list(SPARSE_FIXTURES))
def test_sparse_metal_kernels_match_the_plan(name: str, tmp_path: Path) -> None:
    check_metal_plan(name, tmp_path, sparse_fixture(name, tmp_path))


# --------------------------------------------------------------------- no adapter: retried, hint whole

DRIVER_SAYS = ("Failed to create instance: the vulkan drivers/libraries could not be loaded, "
               "ERROR_INCOMPATIBLE_DRIVER from every ICD found in /usr/share/vulkan/icd.d and the "
               "loader's search path (check VK_ICD_FILENAMES and VK_LOADER_DEBUG=all for the reason "
               "each candidate driver was rejected by the loader at startup time)")
HINT = "install a Vulkan driver, e.g. Mesa's lavapipe: apt-get install mesa-vulkan-drivers libvulkan1"


class _Reached(Exception):
    """The fake adapter's limits were read: the request itself succeeded."""


def _fake_wgpu(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[str]:
    """A wgpu whose adapter request fails `failures` times; returns the log of requests and waits."""
    from types import SimpleNamespace

    from ggufc.runtime import wgpu_runtime

    calls: list[str] = []

    class Adapter:
        @property
        def limits(self) -> dict:
            raise _Reached

    def request_adapter_sync(**_: object) -> Adapter:
        calls.append("request")
        if calls.count("request") <= failures:
            raise RuntimeError(DRIVER_SAYS)
        return Adapter()

    monkeypatch.setattr(wgpu_runtime, "_wgpu", lambda: SimpleNamespace(gpu=SimpleNamespace(
        request_adapter_sync=request_adapter_sync)))
    monkeypatch.setattr(wgpu_runtime.time, "sleep", lambda seconds: calls.append(f"wait {seconds}"))
    return calls


def test_adapter_request_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    from ggufc.runtime.wgpu_runtime import WgpuDevice

    calls = _fake_wgpu(monkeypatch, failures=2)
    with pytest.raises(_Reached):
        WgpuDevice()
    assert calls == ["request", "wait 0.25", "request", "wait 0.5", "request"]  # two transient failures


def test_no_adapter_keeps_the_whole_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's words are shortened at a word, never the install hint, also through the
    session's and the CLI's one-line wrapping."""
    from ggufc.messages import one_line
    from ggufc.runtime.artifact import one_line as runtime_one_line
    from ggufc.runtime.wgpu_runtime import WgpuDevice, WgpuUnavailableError

    calls = _fake_wgpu(monkeypatch, failures=99)
    with pytest.raises(WgpuUnavailableError) as info:
        WgpuDevice()
    assert 2 < calls.count("request") < 10
    for message in (str(info.value), f"cannot run here: {runtime_one_line(info.value)}", one_line(info.value)):
        assert message.endswith(HINT), message
        reason = message[message.index("(") + 1: message.rindex(")")]
        words = reason.removesuffix(" ...").split()
        assert words and words == DRIVER_SAYS.split()[: len(words)], message  # whole words, from the start


def test_one_line_never_cuts_a_word() -> None:
    from ggufc.messages import one_line

    text = " ".join(f"word{i}" for i in range(200))
    short = one_line(RuntimeError(text))
    assert len(short) <= 300 and short.endswith(" ...")
    assert all(w in text.split() for w in short.removesuffix(" ...").split())
