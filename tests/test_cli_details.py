"""Smaller things a new user meets: inspect's listing, argument limits, verify's token checks, a
quiet and native-only vulkan device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from ggufc.driver.inspect_model import natural_key
from tests.support.gpu_support import golden_fixture, need_vulkan

Q4_1_FIXTURE = Path(__file__).parent / "goldens" / "llama-dense-Q4_1.gguf"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGUFC_DEBUG", raising=False)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_natural_order_of_tensor_names() -> None:
    names = ["blk.10.attn_q.weight", "blk.2.attn_q.weight", "output.weight", "blk.1.ffn_up.weight"]
    assert sorted(names, key=natural_key) == [
        "blk.1.ffn_up.weight", "blk.2.attn_q.weight", "blk.10.attn_q.weight", "output.weight",
    ]


def test_inspect_lists_tensors_in_natural_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["inspect", golden_fixture("llama-dense"), "--json"], capsys)
    assert code == 0, err
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert names == sorted(names, key=natural_key) and len(names) > 10


def test_inspect_shows_hyper_parameters_of_unsupported_architectures(capsys: pytest.CaptureFixture[str]) -> None:
    fixture = golden_fixture("kimi-k3-moe")
    code, out, err = run_cli(["inspect", fixture], capsys)
    if code == 0:
        pytest.skip("kimi-k3 is supported now; this checks an architecture ggufc cannot build")
    assert "hyper-parameters (as the file states them):" in out
    assert "  block_count: " in out and "  embedding_length: " in out
    assert err.strip().startswith("ggufc: error: ") and "not supported" in err


def test_bench_threads_beyond_the_cpus_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["bench", "--threads", "1000"], capsys)
    assert code == 2
    assert "1000 threads, but this process may run on" in err and len(err.strip().splitlines()) == 1


def test_verify_token_outside_the_vocabulary_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["verify", golden_fixture("llama-dense"), "--tokens", "1,2,99999"], capsys)
    assert code == 1
    assert err.strip() == "ggufc: error: --tokens: token id 99999 outside the vocabulary [0, 128)"


def test_verify_more_tokens_than_the_context_refused(capsys: pytest.CaptureFixture[str]) -> None:
    tokens = ",".join(["1"] * 40)
    code, _, err = run_cli(["verify", golden_fixture("llama-dense"), "--ctx", "32", "--tokens", tokens], capsys)
    assert code == 1 and "longer than the context (32 tokens)" in err


def test_verify_runs_with_8bit_block_sums(capsys: pytest.CaptureFixture[str]) -> None:
    """Q4_1 weights take q8_1 activations, whose block sums are a second output of the rounding
    (compared as a value of their own when the 8-bit matmul kernels do not round their input)."""
    code, out, err = run_cli(["verify", Q4_1_FIXTURE, "--tokens", "3,1,4,1,5"], capsys)
    assert code == 0, err
    assert "worst:" in out
    rows = [tuple(line.split()[:2]) for line in out.split("\n\n")[0].splitlines()[1:]]
    assert ("-", "result_output") in rows and len(rows) == len(set(rows)), out  # each value listed once
    code, out, err = run_cli(["verify", Q4_1_FIXTURE, "--tokens", "3,1,4,1,5", "--disable-pass", "fuse_int8_matmul"],
                             capsys)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if "_q8_1_sums" in line]
    assert rows, out


def _device_probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from ggufc.runtime.wgpu_runtime import WgpuDevice\nprint(WgpuDevice().description)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_vulkan_device_is_quiet_without_a_window_system() -> None:
    need_vulkan()
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    proc = _device_probe(env)
    assert proc.returncode == 0, proc.stderr
    assert "(Vulkan)" in proc.stdout
    assert "XDG_RUNTIME_DIR" not in proc.stderr


def test_no_vulkan_driver_means_no_device_not_opengl() -> None:
    need_vulkan()  # wgpu is installed; now hide the Vulkan driver from it
    hidden = {"VK_ICD_FILENAMES": "/nonexistent.json", "VK_DRIVER_FILES": "/nonexistent.json"}
    proc = _device_probe({**os.environ, **hidden})
    assert proc.returncode != 0
    assert "WgpuUnavailableError: no Vulkan/Metal/D3D12 adapter" in proc.stderr
    assert "OpenGL" not in proc.stdout


def test_two_processes_compile_a_model_once(tmp_path: Path) -> None:
    """Two commands started together on the same uncached model: one compiles, the other waits on
    the cache entry's lock and loads that artifact; both answer."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.array([1, 2, 3], dtype=np.int32))
    env = {**os.environ, "GGUFC_CACHE": str(tmp_path / "cache")}
    runs = [
        subprocess.Popen([sys.executable, "-m", "ggufc.cli", "eval", str(Q4_1_FIXTURE), "--tokens", str(tokens),
                          "--out", str(tmp_path / f"logits{i}.npy")], env=env, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    errors = [proc.communicate(timeout=600)[1] for proc in runs]
    assert [proc.returncode for proc in runs] == [0, 0], errors
    assert sum("first use" in err for err in errors) == 1, errors
    np.testing.assert_array_equal(np.load(tmp_path / "logits0.npy"), np.load(tmp_path / "logits1.npy"))


def test_exits_without_waiting_for_spinning_kernel_threads(tmp_path: Path) -> None:
    """A finished command exits at once: TVM's CPU pool workers spin TVM_THREAD_POOL_SPIN_COUNT
    yields before they notice the exit, which takes minutes when every core is busy; here the spin
    is made that long on an idle machine (before `entry`, this eval had not exited after 120 s)."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.array([1, 2, 3], dtype=np.int32))
    env = {**os.environ, "TVM_THREAD_POOL_SPIN_COUNT": "2000000000", "TVM_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "ggufc.cli", "eval", str(Q4_1_FIXTURE), "--tokens", str(tokens),
                           "--out", str(tmp_path / "logits.npy")], env=env, capture_output=True, text=True,
                          timeout=300)  # compiling on first use included; the spin alone would take far longer
    assert proc.returncode == 0, proc.stderr
    assert np.load(tmp_path / "logits.npy").shape == (3, 128)
