"""A golden fixture compiled for the GPU targets without a GPU: cuda's kernels through nvcc to PTX,
metal's kernels against the plan that dispatches them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from ggufc.cli import main
from tests.support.gpu_support import golden_fixture, need_nvcc

# decode steps not captured as one CUDA graph: qwen4exp's PLE hash (and QSA indexer, when sparse) has
# no variant reading the position from device memory, so it (and the kernels Relax leaves between
# the resulting graphs) launches one by one; most launches are still captured
SPLIT_DECODE_GRAPH = {
    "qwen4exp-moe": {"ple_hash"},
    # the compressed-row kernels and minimax-m3's block selection take the position as a scalar too
    "deepseek4-moe-F16-sparse": {"compressed_attention", "compressed_score"},
    "minimax-m3-moe-sparse": {"block_topk"},
}


def build_for(path: Path, target: str) -> object:
    import os

    from ggufc.driver.stages import build_model
    from ggufc.frontend.load import load_model

    os.environ["GGUFC_CUDA_BINARY"] = "0"  # the test compiles the source itself
    try:
        return build_model(load_model(path), target)
    finally:
        del os.environ["GGUFC_CUDA_BINARY"]


def cuda_build_with_ptx(path: Path) -> tuple[Any, str]:
    """The cuda build of `path` and its source compiled to PTX (sm_80) by nvcc, every kernel an `.entry`
    (asserted)."""
    need_nvcc()
    from ggufc.codegen.gpu.build import nvcc_compile

    built: Any = build_for(path, "cuda")
    ptx = nvcc_compile(built.executable.cuda_source, "ptx", ("sm_80",)).decode()
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
    missing = [k for k in built.kernel_names if not any(e == f"{k}_kernel" or e.startswith(f"{k}_kernel_")
                                                         for e in entries)]
    assert not missing, f"kernels without PTX entry: {missing}"
    return built, ptx


def check_cuda_ptx(name: str, path: Path | None = None) -> None:
    """Every kernel of the golden fixture `name` (at `path`, by default the golden file) compiles to PTX
    with nvcc (each kernel an `.entry`), and the decode step is captured as CUDA graphs as
    SPLIT_DECODE_GRAPH says."""
    built, ptx = cuda_build_with_ptx(path or golden_fixture(name))
    assert ".target sm_80" in ptx
    graph = built.executable.manifest["cuda"]["cuda_graph"]["decode"]
    if name in SPLIT_DECODE_GRAPH:  # the kernels taking the position as a scalar run between graphs
        assert graph["captured"] > 10 and graph["graphs"] > 1, graph
        outside = {k.split("_", 1)[1] for k in graph["outside"]}
        assert SPLIT_DECODE_GRAPH[name] <= outside and graph["captured"] > len(graph["outside"]), graph
    else:
        assert graph["graphs"] == 1 and graph["captured"] > 10 and len(graph["outside"]) == 1, graph
    schedules = built.executable.manifest["schedules"]
    assert set(schedules) == set(built.kernel_names)
    assert all(s.startswith(("dlight.", "ggufc.")) for s in schedules.values()), schedules


_MSL_TYPES = {"float32": "float", "int32": "int", "uint32": "uint", "int64": "long", "float16": "half"}


def _msl_kernels(source: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"kernel void (\w+)\((.*?)\)\s*\{", source, flags=re.S):
        out[m.group(1)] = m.group(2)
    return out


def check_metal_plan(name: str, tmp_path: Path, path: Path | None = None) -> dict[str, Any]:
    """Every kernel of the plan of `name` compiled for metal exists in `kernels.metal` with the argument
    contract the Metal dispatcher uses; returns the plan."""
    out = tmp_path / "metal"
    assert main(["compile", str(path or golden_fixture(name)), "-t", "metal", "-o", str(out)]) == 0
    check_metal_artifact(out)
    plan: dict[str, Any] = json.loads((out / "plan.json").read_text())
    return plan


def check_metal_artifact(out: Path) -> None:
    """The checks of `check_metal_plan` on a compiled metal artifact."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target_key"] == "metal" and manifest["gpu"]["runtime"] == "plan"
    plan = json.loads((out / "plan.json").read_text())
    source = (out / "kernels.metal").read_text()
    signatures = _msl_kernels(source)
    assert source.count("#include <metal_stdlib>") == 1
    used = set()
    for fname, fp in plan["functions"].items():
        for step in fp["steps"]:
            entry = step["entry"]
            assert entry in signatures, f"{fname}: no MSL kernel {entry}"
            used.add(step["kernel"])
            sig = signatures[entry]
            kernel = plan["kernels"][step["kernel"]]
            launch = kernel["launches"][step["launch"]]
            bufs = re.findall(r"device (\w+)\* (\w+) \[\[ buffer\((\d+)\) \]\]", sig)
            assert [int(i) for _, _, i in bufs] == list(range(len(step["buffers"]))), entry
            for (ctype, pname, _), b in zip(bufs, launch["buffers"], strict=True):
                assert ctype == _MSL_TYPES[kernel["params"][b]["dtype"]], (entry, pname)
            args = re.search(r"constant (\w+)& arg \[\[ buffer\((\d+)\) \]\]", sig)
            if step["scalars"]:
                assert args and int(args.group(2)) == len(step["buffers"]), entry
                fields = re.search(r"struct " + args.group(1) + r" \{(.*?)\};", source, flags=re.S).group(1)
                types = [ln.split()[0] for ln in fields.strip().splitlines()]
                assert types == [_MSL_TYPES[dt] for _, dt in step["scalars"]], entry
            else:
                assert args is None, entry
            dims = sum(1 for b in step["block"] if b > 1)
            tid = re.search(r"(uint\d?) threadIdx \[\[thread_position_in_threadgroup\]\]", sig)
            assert tid is not None, entry
            assert dims <= (int(tid.group(1)[4:] or 1)), (entry, step["block"], tid.group(1))
            assert np.prod(step["block"]) <= 256
    assert used == set(manifest["kernels"]), "kernels never dispatched by the plan"
    for body in re.split(r"kernel void ", source)[1:]:  # threadgroup memory within Metal's 32 KiB
        shared = sum(int(n) * (2 if t == "half" else 4)
                     for t, n in re.findall(r"threadgroup (\w+) \w+\[(\d+)\];", body))
        assert shared <= 32768
