"""Artifacts for another CPU (`--cpu NAME`): names checked before any work, targets free of this
machine's adjustments, the manifest's record of the CPU, the loader's refusal of a CPU without its
features, the compile cache keyed by CPU, and a `--cpu haswell` model run here against the
interpreter (every x86-64 CPU the project runs on has AVX2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ggufc
from ggufc.cli import main
from ggufc.codegen import target as T
from ggufc.codegen.formats.cpu_schedules import CpuTiles, qmatmul
from ggufc.codegen.kernel_keys import WeightMatmul
from ggufc.codegen.lower import ModuleBuilder
from ggufc.driver import models
from ggufc.driver.stages import optimise
from ggufc.driver.tune.options import TuneError
from ggufc.driver.tune.targets import tune_target
from ggufc.frontend.load import load_model
from ggufc.ir.interp import init_state, run_graph
from ggufc.runtime import artifact as A
from ggufc.runtime import artifact_reader as AR
from ggufc.runtime import host as H
from tests.support.artifact_edits import write_manifest
from tests.support.fixtures import write_fixture

pytestmark = pytest.mark.skipif(H.host_features().machine != "x86_64", reason="x86-64 CPU names")

N_TOKENS = 12
# compiled against the float64 interpreter of the same optimised graph; measured 5.4e-15 (prompt) and
# 6.2e-15 (decode) for a haswell build, 3.1e-15 for this machine's (AVX-512 VNNI) build
NMSE_BOUND = 1e-10


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a - b) ** 2) / np.sum(b**2))


def lacking_cpu() -> str:
    """An x86-64 CPU LLVM knows whose checked features this CPU lacks (every CPU lacks some: Intel
    CPUs AMD's sse4a, AMD CPUs before Zen 4 AVX-512, none of today's APX)."""
    return next(n for n in ("skylake-avx512", "znver2", "graniterapids", "diamondrapids")
                if H.features_missing_here({"kind": "llvm", "mcpu": n}))


def lacking_feature() -> str:
    """A checked x86 extension this CPU does not list."""
    flags = H.host_features().flags or frozenset()
    return next(f for f in H._CHECKED_FEATURES["x86_64"]
                if H._normalise_flag(H._CPUINFO_ALIASES.get(f, f)) not in flags)


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ggufc: error: ") and "\n" not in err, err
    return err


# --------------------------------------------------------------------------- names


def test_cpu_names_checked() -> None:
    assert T.check_cpu_name("haswell") == "haswell"
    assert T.check_cpu_name("x86-64-v3") == "x86-64-v3"  # LLVM's microarchitecture levels are CPU names
    assert T.check_cpu_name("native") is None
    assert {"haswell", "znver2", "x86-64-v3", "sapphirerapids"} <= set(T.known_cpus())
    with pytest.raises(T.UnknownCpu, match="did you mean haswell"):
        T.check_cpu_name("haswel")
    with pytest.raises(T.UnknownCpu, match="known names include haswell"):
        T.check_cpu_name("no-such-cpu")
    with pytest.raises(T.UnknownCpu, match=r"another architecture \(aarch64\)"):
        T.check_cpu_name("cortex-a72")
    with pytest.raises(T.UnknownCpu, match="32-bit"):
        T.check_cpu_name("i686")


def test_target_text_carries_the_cpu() -> None:
    assert T.with_cpu("llvm", "haswell") == "llvm:haswell"
    assert T.with_cpu("cpu", "znver2") == "llvm:znver2"
    assert T.with_cpu("llvm", "native") == "llvm" and T.with_cpu("llvm", None) == "llvm"
    assert T.with_cpu("llvm:haswell", None) == "llvm:haswell"  # spelt out in -t, checked the same
    assert T.with_cpu("vulkan", None) == "vulkan"
    for gpu in ("cuda", "cuda:sm_80", "vulkan", "metal"):
        with pytest.raises(T.UnknownCpu, match=f"--cpu is for CPU targets.*-t {gpu}"):
            T.with_cpu(gpu, "haswell")
    with pytest.raises(T.UnknownCpu, match="name two CPUs"):
        T.with_cpu("llvm:haswell", "znver2")
    with pytest.raises(T.UnknownCpu, match="did you mean"):
        T.with_cpu("llvm:haswel", None)


@pytest.mark.parametrize("argv", [
    ["--cpu", "haswel"], ["--cpu", "cortex-a72"], ["-t", "vulkan", "--cpu", "haswell"], ["-t", "llvm:bogus"],
])
def test_cli_refuses_bad_cpu_before_any_work(argv: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"not even a gguf")  # the name is refused first
    err = one_line_error(capsys, ["compile", str(model), "-o", str(tmp_path / "out"), *argv])
    assert "--cpu" in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- targets


def test_named_cpu_target_has_none_of_this_machines_adjustments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host target switches off what the hypervisor hides and AMX the OS keeps; a named CPU is
    built as LLVM describes it, whatever this machine is."""
    flags = frozenset("pni ssse3 sse41 sse42 avx avx2 fma f16c bmi1 bmi2".split())  # /proc/cpuinfo's names
    monkeypatch.setattr(H, "host_features", lambda: H.HostFeatures("x86_64", flags))
    monkeypatch.setattr(T, "host_features", lambda: H.HostFeatures("x86_64", flags))
    monkeypatch.setattr(T, "host_cpu_name", lambda: "sapphirerapids")
    monkeypatch.setattr(T, "amx_usable", lambda: False)
    host = T.cpu_target(2)
    assert "-avx512f" in set(map(str, host.attrs["mattr"]))
    named = T.resolve_target("llvm:sapphirerapids")
    assert str(named.attrs["mcpu"]) == "sapphirerapids" and not named.attrs.get("mattr")
    assert T.kernel_isa(named) == "amx" and T.kernel_isa(host) == "avx2"


@pytest.fixture
def emulate_cpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets GGUFC_HOST_CPU for one test, with the host's features read afresh before and after."""
    def set_cpu(name: str) -> None:
        monkeypatch.setenv(H.HOST_CPU_ENV, name)
        H.host_features.cache_clear()

    yield set_cpu
    monkeypatch.delenv(H.HOST_CPU_ENV, raising=False)
    H.host_features.cache_clear()


def test_host_cpu_env_makes_this_machine_an_older_cpu(emulate_cpu: Any) -> None:
    """GGUFC_HOST_CPU=haswell: the default target, its kernels and the loader's checks are those of an
    AVX2-only CPU, so this machine runs what such a CPU would."""
    emulate_cpu("haswell")
    assert T.host_cpu_name() == "haswell"
    host = T.cpu_target(2)
    assert str(host.attrs["mcpu"]) == "haswell" and T.kernel_isa(host) == "avx2"
    flags = H.host_features().flags or frozenset()
    assert "avx2" in flags and "avx512f" not in flags and not H.amx_usable()
    assert "avx512f" in H.features_missing_here({"kind": "llvm", "mcpu": "skylake-avx512"})


def test_host_cpu_env_refuses_what_this_cpu_cannot_be(emulate_cpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CPU beyond this one is chosen on the real features, also in a suite run as another CPU
    monkeypatch.delenv(H.HOST_CPU_ENV, raising=False)
    H.host_features.cache_clear()
    beyond_this_cpu = lacking_cpu()
    emulate_cpu("no-such-cpu")
    with pytest.raises(A.ArtifactError, match="GGUFC_HOST_CPU=no-such-cpu: LLVM knows no CPU of that name"):
        H.host_features()
    emulate_cpu(beyond_this_cpu)
    with pytest.raises(A.ArtifactError, match=f"GGUFC_HOST_CPU={beyond_this_cpu}: this CPU lacks its "):
        H.host_features()


@pytest.mark.parametrize(("cpu", "isa"), [
    ("x86-64", "sse"), ("sandybridge", "avx"), ("haswell", "avx2"), ("x86-64-v3", "avx2"), ("znver2", "avx2"),
    ("skylake-avx512", "avx512"), ("alderlake", "avx-vnni"), ("icelake-server", "avx512-vnni"),
    ("sapphirerapids", "amx"),
])
def test_isa_of_named_cpus(cpu: str, isa: str) -> None:
    target = T.named_cpu_target(cpu, 2)
    assert T.kernel_isa(target) == isa
    record = T.cpu_manifest(target, {"kind": "llvm", "mcpu": cpu})
    assert record["cpu"] == cpu and record["isa"] == isa
    assert ("avx2" in record["cpu_features"]) == (isa not in ("sse", "avx"))


def test_float_kernels_take_the_built_cpus_vectors() -> None:
    """A haswell build on an AVX-512 machine sums in AVX2's 8 lanes, as a build on a haswell would."""
    seen: dict[str, CpuTiles] = {}
    for cpu in ("haswell", "skylake-avx512"):
        mb = ModuleBuilder(T.named_cpu_target(cpu, 2), [], [])

        def make(cpu: str = cpu) -> Any:
            seen[cpu] = CpuTiles.for_target()
            return qmatmul("Q4_0", 8, 64, gemv=True)

        mb.kernel(WeightMatmul("Q4_0", 8, 64, True), make)
    assert seen == {"haswell": CpuTiles(vec=8), "skylake-avx512": CpuTiles(vec=16)}


def test_tune_targets_the_named_cpu_or_refuses() -> None:
    target = tune_target("llvm:haswell")
    assert str(target.attrs["mcpu"]) == "haswell" and not target.attrs.get("mattr")
    with pytest.raises(TuneError, match=f"cannot tune for CPU '{lacking_cpu()}' here: this CPU lacks"):
        tune_target(f"llvm:{lacking_cpu()}")


def test_cache_keyed_by_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    dirs = {t: models.cached_artifact_dir(model, t, None) for t in ("llvm", "llvm:haswell", "llvm:znver2")}
    assert len(set(dirs.values())) == 3
    assert f"llvm:host-{T.host_cpu_name()}" in dirs["llvm"].name and "llvm:haswell" in dirs["llvm:haswell"].name


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["eval", "--tokens", "t.npy", "--out", "l.npy"],
                                     ["bench"], ["verify"], ["tune", "--db", "db"]])
def test_running_kernels_this_cpu_lacks_refused(command: list[str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    model = write_fixture("llama", tmp_path / "m.gguf")
    cpu = lacking_cpu()
    argv = [command[0], str(model), *command[1:], "--cpu", cpu]
    err = one_line_error(capsys, argv)
    assert cpu in err and "lacks" in err
    assert not list(tmp_path.glob("*.npy")) and not (tmp_path / "db").exists()


# --------------------------------------------------------------------------- a haswell artifact, run here


@pytest.fixture(scope="module")
def haswell(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("haswell")
    model = write_fixture("llama", folder / "m.gguf", seed=1, qtype="Q4_0", size="bpe", tokenizer="gpt2")
    artifact = ggufc.compile(model, folder / "art", cpu="haswell", n_ctx=64)
    tokens = np.random.default_rng(3).integers(0, 320, N_TOKENS).astype(np.int32)
    np.save(folder / "tokens.npy", tokens)
    return {"folder": folder, "model": model, "artifact": artifact, "tokens": tokens}


def interpreted(model: Path, tokens: np.ndarray, target: str) -> np.ndarray:
    """The spec: the float64 interpreter over the graph the target compiles (with its passes, as
    `ggufc verify` takes it: 8-bit activation rounding included)."""
    loaded = load_model(model, 64)
    graphs, _ = optimise({"prefill_all": loaded.graphs["prefill_all"]}, frozenset(), T.resolve_target(target))
    graph = graphs["prefill_all"]
    res = run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, loaded.param_loader(),
                    init_state(graph, {}, np.float64), dtype=np.float64)
    return np.asarray(res.outputs[0])


def test_manifest_records_the_cpu(haswell: dict[str, Any]) -> None:
    manifest = json.loads((haswell["artifact"] / "manifest.json").read_text())
    assert manifest["target"]["mcpu"] == "haswell" and "mattr" not in manifest["target"]
    assert (manifest["cpu"], manifest["isa"]) == ("haswell", "avx2")
    assert {"avx2", "fma", "f16c", "bmi2"} <= set(manifest["cpu_features"])
    assert not {"avx512f", "avxvnni", "amx-int8"} & set(manifest["cpu_features"])
    assert [k for k in manifest["kernels"] if "int8" in k]  # llama.cpp's 8-bit kernels in their AVX2 form


def test_haswell_artifact_runs_here(haswell: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    folder = haswell["folder"]
    ref = interpreted(haswell["model"], haswell["tokens"], "llvm:haswell")
    for chunk in ("12", "1"):  # the prompt's kernels, then the decode step's
        out = folder / f"logits{chunk}.npy"
        argv = ["eval", str(haswell["artifact"]), "--tokens", str(folder / "tokens.npy"), "--out", str(out)]
        assert main([*argv, "--chunk", chunk]) == 0
        logits = np.load(out)
        assert logits.shape == ref.shape and nmse(logits, ref) <= NMSE_BOUND
    assert main(["verify-artifact", str(haswell["artifact"])]) == 0
    assert "CPU haswell (avx2)" in capsys.readouterr().out


def test_gguf_with_cpu_compiles_into_its_own_cache_entry(haswell: dict[str, Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_CACHE", str(tmp_path / "cache"))
    folder, out = haswell["folder"], tmp_path / "logits.npy"
    argv = ["eval", str(haswell["model"]), "--tokens", str(folder / "tokens.npy"), "--out", str(out)]
    assert main([*argv, "--cpu", "haswell"]) == 0
    entries = [e for e in (tmp_path / "cache" / "artifacts").iterdir() if not e.name.startswith(".")]  # no locks
    assert len(entries) == 1 and "llvm:haswell" in entries[0].name
    assert json.loads((entries[0] / "manifest.json").read_text())["cpu"] == "haswell"
    with ggufc.load(haswell["artifact"], cpu="haswell") as model:  # the same compile, the same logits
        np.testing.assert_array_equal(np.load(out), model.eval(haswell["tokens"]))
    with ggufc.load(haswell["model"], cpu="haswell") as model:  # the API finds the cache entry
        assert model.session.manifest["cpu"] == "haswell" and model.complete("hello", max_tokens=4)
    assert len(list((tmp_path / "cache" / "artifacts").glob("m-*"))) == 1


def test_artifact_for_another_cpu_than_asked_refused(haswell: dict[str, Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, ["bench", str(haswell["artifact"]), "--cpu", "znver2"])
    assert "--cpu znver2 given, but" in err and "compiled for CPU 'haswell'" in err
    with pytest.raises(ggufc.GgufcError, match="compiled for CPU 'haswell'"):
        ggufc.load(haswell["artifact"], cpu="x86-64-v3")


def test_load_refused_where_the_cpu_lacks_a_feature(haswell: dict[str, Any], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An artifact for a CPU with features this one lacks (the manifest resealed as a build for it
    would write it): refused in one line, by LLVM's name for the CPU and by the recorded list."""
    manifest = json.loads((haswell["artifact"] / "manifest.json").read_text())
    tokens = str(haswell["folder"] / "tokens.npy")
    cpu, feature = lacking_cpu(), lacking_feature()
    edits = {"mcpu": {"target": {**manifest["target"], "mcpu": cpu}, "cpu": cpu},
             "recorded": {"cpu_features": [*manifest["cpu_features"], feature]}}
    for name, edit in edits.items():
        art = tmp_path / name
        shutil.copytree(haswell["artifact"], art)
        write_manifest(art, json.dumps({**manifest, **edit}))
        err = one_line_error(capsys, ["eval", str(art), "--tokens", tokens, "--out", str(tmp_path / "l.npy")])
        assert "this CPU lacks" in err, err
        assert (feature in err) if name == "recorded" else (f"compiled for CPU '{cpu}'" in err)
    assert not (tmp_path / "l.npy").exists()
    write_manifest(art, json.dumps({**manifest, "cpu_features": "avx2"}))
    with pytest.raises(A.ArtifactError, match="'cpu_features' is not a list of strings"):
        AR.load_manifest(art)

