"""A session's context saved to a file and loaded in a new process, refused for another artifact;
device memory released and restored (CPU and vulkan) with unchanged logits. On the hybrid qwen35
fixture (delta-net recurrent state + attention caches)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ggufc
from ggufc.runtime import Session
from tests.support.artifact_edits import write_manifest
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.gpu_support import need_vulkan

pytestmark = skip_without_goldens()
FIXTURE = GOLDEN / "fixtures" / "qwen35-dense.gguf"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ggufc.compile(FIXTURE, tmp_path_factory.mktemp("state") / "qwen35")


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.load(GOLDEN / "logits" / "qwen35-dense.npz")["tokens"]


NEW_PROCESS = """
import sys, numpy as np
from ggufc.runtime import Session
artifact, state, tokens, out = sys.argv[1:]
s = Session(artifact, checkpoint_interval=16)
s.load_state(state)
rest = np.load(tokens)
a = s.forward(rest, all_logits=True)
s.truncate(35)  # from a checkpoint the file brought (32), not from 0
b = s.forward(rest[:5], all_logits=True)
np.savez(out, a=a, b=b, n=s.n_past, replayed=s.stats.replayed_tokens, tokens=s.tokens)
"""


def test_state_file_round_trip_in_a_new_process(artifact: Path, tokens: np.ndarray, tmp_path: Path) -> None:
    session = Session(artifact, checkpoint_interval=16)
    session.forward(tokens[:40], all_logits=True)
    session.save_state(tmp_path / "ctx.npz")
    want = session.forward(tokens[40:], all_logits=True)
    session.truncate(35)
    want_b = session.forward(tokens[40:45], all_logits=True)
    np.save(tmp_path / "rest.npy", tokens[40:])
    run = subprocess.run([sys.executable, "-c", NEW_PROCESS, str(artifact), str(tmp_path / "ctx.npz"),
                          str(tmp_path / "rest.npy"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(got["a"], want)  # same kernels, same state: bit for bit
    np.testing.assert_array_equal(got["b"], want_b)
    assert int(got["n"]) == 40 and int(got["replayed"]) == 3
    np.testing.assert_array_equal(got["tokens"], np.concatenate([tokens[:35], tokens[40:45]]))


def test_state_file_of_another_artifact_is_refused(artifact: Path, tokens: np.ndarray, tmp_path: Path) -> None:
    """Another artifact (here: the same one resealed with a different manifest) refuses the file
    in one line and keeps its own context."""
    import shutil

    session = Session(artifact)
    session.forward(tokens[:10])
    session.save_state(tmp_path / "ctx.npz")
    other = tmp_path / "other"
    shutil.copytree(artifact, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["compile_seconds"] = manifest["compile_seconds"] + 1
    write_manifest(other, manifest)
    foreign = Session(other)
    foreign.forward(tokens[:3])
    with pytest.raises(ValueError, match="another artifact") as err:
        foreign.load_state(tmp_path / "ctx.npz")
    assert "\n" not in str(err.value)
    assert foreign.n_past == 3
    (tmp_path / "junk.npz").write_bytes(b"not a state file")
    with pytest.raises(ValueError, match="not a ggufc state file"):
        session.load_state(tmp_path / "junk.npz")


def test_release_and_restore_on_cpu(artifact: Path, tokens: np.ndarray) -> None:
    """Weights, kernels' scratch and states leave the process; a forward brings them back by
    itself; the logits are those of a session never released."""
    fresh = Session(artifact)
    want = fresh.forward(tokens, all_logits=True)
    session = Session(artifact, checkpoint_interval=16)
    session.forward(tokens[:40], all_logits=True)
    weight_bytes = int(session.manifest["weight_bytes"])
    before = session.memory()
    session.release_device()
    after = session.memory()
    assert session.released and after["shadow_bytes"] > 0
    assert before["rss_bytes"] - after["rss_bytes"] >= weight_bytes // 2, (before, after, weight_bytes)
    got = session.forward(tokens[40:], all_logits=True)  # restores by itself
    assert not session.released
    np.testing.assert_array_equal(got, want[40:])
    session.release_device(evict_state=False)
    session.restore_device()
    session.truncate(20)
    np.testing.assert_array_equal(session.forward(tokens[20:], all_logits=True), want[20:])


def test_release_and_restore_on_vulkan(tokens: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> None:
    need_vulkan()
    artifact = ggufc.compile(FIXTURE, tmp_path_factory.mktemp("vk") / "qwen35", target="vulkan")
    want = Session(artifact, device="vulkan").forward(tokens, all_logits=True)
    session = Session(artifact, device="vulkan", checkpoint_interval=16)
    session.forward(tokens[:40], all_logits=True)
    before = session.memory()["device_bytes"]
    session.release_device()
    after = session.memory()["device_bytes"]
    assert before > 1_000_000 and after <= 4096, (before, after)  # the token buffer stays
    got = session.forward(tokens[40:], all_logits=True)
    assert session.memory()["device_bytes"] == before
    np.testing.assert_array_equal(got, want[40:])
    session.release_device(evict_state=False)
    kept = session.memory()["device_bytes"]
    assert after < kept < before  # the states stayed on the device
    session.truncate(30)
    np.testing.assert_array_equal(session.forward(tokens[30:], all_logits=True), want[30:])
