"""Artifact writing and verification: round trip, every refusal, atomic replacement."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ggufc import __version__
from ggufc.driver.compile import plain_target
from ggufc.runtime import artifact as A
from ggufc.runtime import artifact_reader as AR
from ggufc.runtime import artifact_writer as AW
from ggufc.runtime import host as H
from ggufc.runtime.artifact import ArtifactError
from ggufc.runtime.artifact_reader import load_manifest, read_weights
from ggufc.runtime.artifact_writer import finalize_artifact
from tests.support.artifact_edits import write_manifest

WEIGHTS = {
    "a.qs": np.arange(6 * 35, dtype=np.uint8).reshape(6, 35),  # odd size: the next array must realign
    "a.d": np.linspace(-1, 1, 6 * 2, dtype=np.float16).reshape(6, 2),
    "norm": np.arange(7, dtype=np.float32),
}


def manifest_fields(**overrides: object) -> dict:
    fields: dict = {
        "arch": "llama",
        "hparams": {"n_embd": 7},
        "n_ctx": 32,
        "n_vocab": 6,
        "target": {"kind": "llvm"},
        "target_key": "llvm",
        "functions": {"prefill_all": {"tokens": "T"}, "prefill": {"tokens": "T"}, "decode": {"tokens": 1}},
        "max_chunk": 8,
        "params": [
            {
                "name": "a",
                "qtype": "Q4_0",
                "arrays": [
                    {"key": "a.qs", "shape": [6, 35], "dtype": "uint8"},
                    {"key": "a.d", "shape": [6, 2], "dtype": "float16"},
                ],
            },
            {"name": "norm", "qtype": "F32", "arrays": [{"key": "norm", "shape": [7], "dtype": "float32"}]},
        ],
        "states": [{"name": "k_cache", "shape": [32, 7], "dtype": "float32"}],
        "tokenizer": {
            "file": "tokenizer.json",
            "bos_id": 1,
            "eos_id": 2,
            "eot_ids": [],
            "add_bos": True,
            "chat_template": None,
            "model": "gpt2",
        },
        "source": {"file": "m.gguf", "sha256": "0" * 64},
        "passes": {},
        "kernels": [],
    }
    fields.update(overrides)
    return fields


def stage(tmp_path: Path, out_name: str = "art") -> Path:
    staging = AW.make_staging_dir(tmp_path / out_name)
    (staging / "kernels.so").write_bytes(b"\x7fELF not really a library" * 100)
    save_file(WEIGHTS, str(staging / "weights.safetensors"))
    (staging / "tokenizer.json").write_text('{"model": {}}', encoding="utf-8")
    return staging


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    out = tmp_path / "art"
    finalize_artifact(stage(tmp_path), out, manifest_fields())
    return out


def edit_manifest(path: Path, **changes: object) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    write_manifest(path, json.dumps(manifest))


# --------------------------------------------------------------------------- round trip


def test_round_trip(artifact: Path) -> None:
    manifest = load_manifest(artifact, target_key="llvm")
    assert manifest["format_version"] == A.FORMAT_VERSION
    assert manifest["ggufc_version"] == __version__
    assert set(manifest["files"]) == {"kernels.so", "weights.safetensors", "tokenizer.json"}
    assert manifest["files"]["kernels.so"] == A.sha256_file(artifact / "kernels.so")
    assert manifest["params"] == manifest_fields()["params"]
    arrays = read_weights(artifact, manifest)
    for got, want in zip(arrays, WEIGHTS.values(), strict=True):
        assert got.ctypes.data % 64 == 0 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)
    assert not [p for p in artifact.parent.iterdir() if p.name.startswith(".art.")]  # no staging left


def test_archive_round_trip(artifact: Path, tmp_path: Path) -> None:
    archive = tmp_path / "art.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(artifact, arcname=".")
    assert AR.is_artifact(archive)
    with AR.open_artifact(archive) as opened:
        root = opened.path
        assert opened.manifest["arch"] == "llama"
        np.testing.assert_array_equal(read_weights(root, opened.manifest)[2], WEIGHTS["norm"])
    assert not root.exists()


# --------------------------------------------------------------------------- refusals


def refused(path: Path, match: str, **kw: object) -> None:
    with pytest.raises(ArtifactError, match=match) as info:
        load_manifest(path, **kw)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_tampered_byte_refused(artifact: Path) -> None:
    weights = artifact / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    refused(artifact, "weights.safetensors does not match its manifest sha256")


def test_truncated_file_refused(artifact: Path) -> None:
    kernels = artifact / "kernels.so"
    kernels.write_bytes(kernels.read_bytes()[:100])
    refused(artifact, "kernels.so does not match its manifest sha256 .modified or truncated.")


def test_missing_file_refused(artifact: Path) -> None:
    (artifact / "tokenizer.json").unlink()
    refused(artifact, "tokenizer.json is missing")


def test_unlisted_referenced_file_refused(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    del manifest["files"]["weights.safetensors"]
    write_manifest(artifact, json.dumps(manifest))
    refused(artifact, "manifest does not list weights.safetensors")


def test_unsafe_listed_path_refused(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"]["../outside"] = "0" * 64
    write_manifest(artifact, json.dumps(manifest))
    refused(artifact, "unsafe path")


def test_wrong_format_version_refused(artifact: Path) -> None:
    edit_manifest(artifact, format_version=A.FORMAT_VERSION + 1)
    refused(artifact, f"format version {A.FORMAT_VERSION + 1}, this runtime reads version {A.FORMAT_VERSION}")


def test_incompatible_ggufc_version_refused(artifact: Path) -> None:
    edit_manifest(artifact, ggufc_version="99.0.0")
    refused(artifact, "built by ggufc 99.0.0, incompatible")


@pytest.mark.parametrize("ubatch", [0, 10**9, "512", True])
def test_bad_ubatch_refused(artifact: Path, ubatch: object) -> None:
    edit_manifest(artifact, ubatch=ubatch)
    refused(artifact, r"manifest field 'ubatch' must be a token count in \[1, max_chunk\]")


def test_patch_version_difference_accepted(artifact: Path) -> None:
    major, minor = __version__.split(".")[:2]
    edit_manifest(artifact, ggufc_version=f"{major}.{minor}.999")
    load_manifest(artifact)


def test_wrong_target_key_refused(artifact: Path) -> None:
    refused(artifact, "compiled for target 'llvm', not 'cuda'; recompile with -t cuda", target_key="cuda")


def test_other_cpu_architecture_refused(artifact: Path) -> None:
    other = "aarch64" if H.host_features().machine != "aarch64" else "x86_64"
    edit_manifest(artifact, target={"kind": "llvm", "mtriple": f"{other}-linux-gnu"})
    refused(artifact, f"compiled for {other}, this machine is")


def test_missing_cpu_features_refused(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tvm")
    if H.host_features().machine != "x86_64":
        pytest.skip("x86 CPU names")
    monkeypatch.setattr(H, "host_features", lambda: H.HostFeatures("x86_64", frozenset({"sse", "sse2"})))
    edit_manifest(artifact, target={"kind": "llvm", "mcpu": "haswell"})
    refused(artifact, "compiled for CPU 'haswell', whose .*avx2.* this CPU lacks")


def test_host_cpu_target_accepted(artifact: Path) -> None:
    pytest.importorskip("tvm")
    from ggufc.codegen.target import cpu_target, host_cpu_name

    edit_manifest(artifact, target=plain_target(dict(cpu_target(2).export())))
    load_manifest(artifact, target_key="llvm")
    host_cpu = host_cpu_name()
    hidden = H.features_missing_here({"kind": "llvm", "mcpu": host_cpu})
    if hidden:  # a CPU whose model name implies more than it has (a hypervisor hiding AMX): refused
        edit_manifest(artifact, target={"kind": "llvm", "mcpu": host_cpu, "num-cores": 2})
        refused(artifact, f"whose {hidden[0]}.* this CPU lacks")


def test_target_switches_off_what_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU that LLVM names 'skylake-avx512' but whose /proc/cpuinfo hides AVX-512 (as hypervisors
    hide AMX): the compiler's host target switches those features off, and the check accepts it."""
    pytest.importorskip("tvm")
    from ggufc.codegen import target as T

    flags = frozenset("sse3 ssse3 sse41 sse42 avx avx2 fma f16c bmi1 bmi2".split())
    monkeypatch.setattr(T, "host_cpu_name", lambda: "skylake-avx512")
    monkeypatch.setattr(H, "host_features", lambda: H.HostFeatures("x86_64", flags))
    spec = dict(T.cpu_target(2).export())
    assert {"-avx512f", "-avx512bw", "-avx512vl"} <= set(map(str, spec["mattr"]))
    assert H.features_missing_here(plain_target(spec)) == []
    assert "avx512f" in H.features_missing_here({"kind": "llvm", "mcpu": "skylake-avx512"})


def test_garbled_manifest_refused(artifact: Path) -> None:
    write_manifest(artifact, "{not json")
    refused(artifact, "unreadable manifest")


def test_missing_directory_refused(tmp_path: Path) -> None:
    refused(tmp_path / "nowhere", "no such artifact")
    refused(tmp_path, "not an artifact")


def test_kernels_never_loaded_when_refused(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tvm = pytest.importorskip("tvm")
    from ggufc.runtime.session import Session

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("kernels.so loaded before verification")

    monkeypatch.setattr(tvm.runtime, "load_module", forbidden)
    (artifact / "kernels.so").write_bytes(b"evil")
    with pytest.raises(ArtifactError, match="kernels.so does not match"):
        Session(artifact)


def test_weights_not_matching_manifest_layout_refused(tmp_path: Path) -> None:
    params = manifest_fields()["params"]
    params[1]["arrays"][0]["shape"] = [8]
    out = tmp_path / "art"
    finalize_artifact(stage(tmp_path), out, manifest_fields(params=params))
    with pytest.raises(
        ArtifactError, match=r"weights array 'norm' is float32\[7\], manifest says float32\[8\]"
    ):
        read_weights(out, load_manifest(out))


def test_archive_with_path_traversal_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"boom"))
    refused(archive, "points outside the artifact")
    assert not (tmp_path.parent / "escape.txt").exists()


def test_archive_with_symlink_refused(tmp_path: Path) -> None:
    archive = tmp_path / "link.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    refused(archive, "is not a regular file")


def test_not_an_archive_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"no tar here" * 100)
    refused(junk, "not an artifact directory or a .tar archive of one")


# --------------------------------------------------------------------------- writing


def test_finalize_requires_referenced_files(tmp_path: Path) -> None:
    staging = stage(tmp_path)
    (staging / "kernels.so").unlink()
    with pytest.raises(ArtifactError, match="kernels.so is missing from the staging directory"):
        finalize_artifact(staging, tmp_path / "art", manifest_fields())
    assert not (tmp_path / "art").exists()


def test_finalize_requires_manifest_fields(tmp_path: Path) -> None:
    fields = manifest_fields()
    del fields["n_ctx"]
    with pytest.raises(ArtifactError, match="manifest field 'n_ctx' is missing"):
        finalize_artifact(stage(tmp_path), tmp_path / "art", fields)


def test_failure_mid_write_leaves_no_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(directory: Path, manifest: dict) -> None:
        (directory / "manifest.json.tmp").write_text("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(AW, "_write_manifest", disk_full)
    with pytest.raises(OSError):
        finalize_artifact(stage(tmp_path), tmp_path / "art", manifest_fields())
    assert not (tmp_path / "art").exists()


def test_replacing_keeps_old_artifact_until_new_one_is_complete(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_manifest = load_manifest(artifact)
    real_rename = os.rename

    def rename_fails_to_install(src: str, dst: str) -> None:
        if Path(dst) == artifact.absolute() and ".old-" not in str(src):
            raise OSError(5, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_fails_to_install)
    with pytest.raises(OSError):
        finalize_artifact(stage(tmp_path), artifact, manifest_fields(arch="qwen3"))
    monkeypatch.setattr(os, "rename", real_rename)
    assert load_manifest(artifact) == old_manifest  # the old artifact was put back intact
    finalize_artifact(stage(tmp_path), artifact, manifest_fields(arch="qwen3"))
    assert load_manifest(artifact)["arch"] == "qwen3"
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]  # the replaced copy was removed


def test_staging_on_another_filesystem_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    staging = stage(tmp_path)
    monkeypatch.setattr(AW, "_same_filesystem", lambda a, b: Path(a) != staging)
    finalize_artifact(staging, tmp_path / "art", manifest_fields())
    monkeypatch.undo()
    assert not staging.exists()
    assert load_manifest(tmp_path / "art")["arch"] == "llama"


# --------------------------------------------------------------------------- hostile manifests


def test_huge_manifest_refused_before_parsing(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AR, "MAX_MANIFEST_BYTES", 100)
    refused(artifact, r"manifest is \d+ bytes \(limit 100\)")


def test_deeply_nested_manifest_refused(artifact: Path) -> None:
    write_manifest(artifact, "[" * 200_000 + "]" * 200_000)
    refused(artifact, r"unreadable manifest \(nested too deeply\)")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"key": "norm", "shape": [7], "dtype": "O"}, "unsupported shape/dtype"),
        ({"key": "norm", "shape": [-7], "dtype": "float32"}, "unsupported shape/dtype"),
        ({"key": "norm", "shape": [1 << 40, 1 << 20], "dtype": "float32"}, "claims more than"),
    ],
)
def test_hostile_array_layouts_refused(artifact: Path, spec: dict, match: str) -> None:
    params = manifest_fields()["params"]
    params[1]["arrays"] = [spec]
    edit_manifest(artifact, params=params)
    refused(artifact, match)


def test_weights_claimed_beyond_the_file_are_not_allocated(tmp_path: Path) -> None:
    params = manifest_fields()["params"]
    params[1]["arrays"][0]["shape"] = [1 << 34]  # 64 GiB of float32, in a file of a few hundred bytes
    out = tmp_path / "art"
    finalize_artifact(stage(tmp_path), out, manifest_fields(params=params))
    with pytest.raises(ArtifactError, match=r"manifest claims \d+ bytes of weights, the file holds fewer"):
        read_weights(out, load_manifest(out))


def test_nul_in_listed_path_refused(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"]["kernels\u0000.so"] = "0" * 64
    write_manifest(artifact, json.dumps(manifest))
    refused(artifact, "unsafe path")


# --------------------------------------------------------------------------- verify_report


def report(path: Path, **kw: object) -> dict[str, tuple[bool, str]]:
    return {c.name: (c.ok, c.detail) for c in AR.verify_report(path, **kw)}  # type: ignore[arg-type]


def test_verify_report_of_a_good_artifact(artifact: Path) -> None:
    checks = report(artifact, target_key="llvm")
    assert list(checks) == [
        "manifest",
        "manifest digest",
        "format version",
        "ggufc version",
        "fields",
        "target",
        "kernels.so",
        "tokenizer.json",
        "weights.safetensors",
        "layout",
    ]
    assert all(ok for name, (ok, _) in checks.items() if name != "layout")
    assert checks["kernels.so"][1] == "sha256 matches"
    # the stand-in kernels.so is no library: the layout the kernels were built for cannot be read
    ok, detail = checks["layout"]
    assert not ok and detail.startswith(f"{A.KERNELS_NAME} has no layout function (")


def test_verify_report_goes_on_after_a_failure(artifact: Path) -> None:
    edit_manifest(artifact, format_version=7)
    (artifact / "tokenizer.json").unlink()
    (artifact / "kernels.so").write_bytes(b"truncated")
    checks = report(artifact)
    failed = {name for name, (ok, _) in checks.items() if not ok}
    assert failed == {"format version", "kernels.so", "tokenizer.json"}
    expected = f"artifact format version 7, this runtime reads version {A.FORMAT_VERSION}"
    assert checks["format version"][1].startswith(expected)
    assert checks["tokenizer.json"] == (False, "is missing")
    assert checks["kernels.so"] == (False, "does not match its manifest sha256 (modified or truncated)")
    assert checks["weights.safetensors"] == (True, "sha256 matches")


def test_verify_report_flags_unlisted_files_and_unusable_manifests(artifact: Path, tmp_path: Path) -> None:
    (artifact / "extra.bin").write_bytes(b"?")
    assert report(artifact)["extra.bin"] == (False, "not listed in the manifest (added after sealing?)")
    write_manifest(artifact, "[]")
    not_an_object = f"{artifact / 'manifest.json'}: manifest is not a JSON object"
    assert report(artifact) == {"manifest": (False, not_an_object)}
    assert report(tmp_path / "nowhere") == {"artifact": (False, "no such file or directory")}


def test_verify_report_of_an_archive_extracts_nothing_outside(artifact: Path, tmp_path: Path) -> None:
    archive = tmp_path / "art.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(artifact, arcname=".")
    checks = report(archive)
    assert checks["archive"] == (True, "safe to extract")
    assert all(ok for name, (ok, _) in checks.items() if name != "layout")  # stand-in kernels.so


def test_verify_report_keeps_hostile_strings_on_one_line(artifact: Path) -> None:
    edit_manifest(artifact, ggufc_version=f"{__version__}\nall good\x1b[2J")
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"]["evil\nname"] = "0" * 64
    write_manifest(artifact, json.dumps(manifest))
    checks = AR.verify_report(artifact)
    assert all("\n" not in c.name + c.detail and "\x1b" not in c.detail for c in checks)
    assert ("evil\\nname", False, "is missing") in [(c.name, c.ok, c.detail) for c in checks]
