"""Run a vulkan or metal artifact: its dispatch plan on a GPU through a small backend.

The plan (`plan.json`, written by `ggufc.codegen.gpu.plan`) lists, for each entry point, every
device dispatch of a step: kernel entry, buffers (param / state / token / intermediate slot /
constant), POD arguments and grid size as expressions over `n` (tokens in the call) and `p`
(tokens already in the context). At load everything static is done once: weights uploaded,
states and slots allocated, every pipeline compiled, every dispatch's bindings created. A step
then only evaluates the expressions (one compiled function per entry point), writes one
argument buffer and records all dispatches into one command buffer, then reads the logits.

Backends: `WgpuBackend` (WGSL through wgpu-py: Vulkan, also Metal/D3D12 where wgpu runs) and
`MetalBackend` (MSL through PyObjC's Metal bindings, `metal_runtime.py`). The plan is checked
before use: every reference in range, every expression a plain integer expression, every grid
inside the device limits at run time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufc.messages import GgufcError

from .artifact import ArtifactError, check_layout_contract, one_line
from .metal_runtime import MetalBackend
from .plan_expr import PlanExprError, compile_many
from .plan_format import PLAN_VERSION, WGSL_SEPARATOR
from .wgpu_runtime import WgpuBackend

MAX_PLAN_BYTES = 256 << 20
MAX_SLOT_BYTES = 1 << 40


class PlanError(GgufcError, ValueError):
    """A plan that cannot be run (malformed, or needing more than the device offers)."""


# ---------------------------------------------------------------------------------------------
# reading and checking a plan


def read_plan(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_PLAN_BYTES:
        raise PlanError(f"{path}: plan is {size} bytes (limit {MAX_PLAN_BYTES})")
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PlanError(f"{path}: unreadable plan ({str(exc).splitlines()[0]})") from None
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise PlanError(f"{path}: plan version {plan.get('version') if isinstance(plan, dict) else '?'} "
                        f"(this runtime reads {PLAN_VERSION})")
    return plan


def artifact_file(manifest: dict[str, Any], name: Any) -> str:
    """A file the manifest names for the GPU runtime: a plain name among its hash-checked files."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        files = {}
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".") \
            or name not in files:
        raise PlanError(f"manifest names GPU file {name!r:.60}, which is not one of the artifact's checked files")
    return name


def split_wgsl_bundle(text: str) -> dict[str, str]:
    """`kernels.wgsl` -> {"KERNEL/ENTRY": shader source}."""
    out: dict[str, str] = {}
    parts = text.split(WGSL_SEPARATOR)
    for part in parts[1:]:
        head, _, body = part.partition("\n")
        out[head.strip()] = body
    return out


@dataclass
class Dispatch:
    key: str  # "KERNEL/ENTRY"
    entry: str
    buffers: list[tuple[str, int]]  # resolved refs
    scalar_types: list[str]
    block: tuple[int, int, int]
    expr_base: int  # index of this dispatch's scalars, then its 3 grid values, in the evaluated tuple


@dataclass
class Output:
    ref: tuple[str, int]
    shape: Any  # (n, p) -> tuple of ints
    dtype: np.dtype[Any]


@dataclass
class FunctionPlan:
    name: str
    fixed_tokens: int | None
    dispatches: list[Dispatch]
    evaluate: Any  # (n, p) -> tuple of ints
    outputs: list[Output]


def _ref(ref: Any, counts: dict[str, int], where: str) -> tuple[str, int]:
    if not isinstance(ref, list) or not ref or ref[0] not in ("param", "state", "tokens", "slot", "const"):
        raise PlanError(f"{where}: bad buffer reference {ref!r:.60}")
    if ref[0] == "tokens":
        return ("tokens", 0)
    if len(ref) != 2 or type(ref[1]) is not int or not 0 <= ref[1] < counts[ref[0]]:
        raise PlanError(f"{where}: buffer reference {ref!r:.60} out of range")
    return (ref[0], int(ref[1]))


def prepare_functions(plan: dict[str, Any], counts: dict[str, int]) -> dict[str, FunctionPlan]:
    functions = plan.get("functions")
    if not isinstance(functions, dict) or not functions:
        raise PlanError("plan has no functions")
    names = ["n", "p"]
    out = {}
    for fname, fp in functions.items():
        if not isinstance(fp, dict) or not isinstance(fp.get("steps"), list):
            raise PlanError(f"plan function {fname!r:.40} is malformed")
        texts: list[str] = []
        dispatches = []
        for i, st in enumerate(fp["steps"]):
            where = f"plan {fname} step {i}"
            try:
                scalars = [(str(e), str(t)) for e, t in st["scalars"]]
                grid = [str(g) for g in st["grid"]]
                block = tuple(int(b) for b in st["block"])
                bufs = [_ref(r, counts, where) for r in st["buffers"]]
                key = f"{st['kernel']}/{st['entry']}"
            except (KeyError, TypeError, ValueError) as exc:
                raise PlanError(f"{where}: malformed ({exc})") from None
            if len(grid) != 3 or len(block) != 3 or any(b < 1 or b > 1024 for b in block):
                raise PlanError(f"{where}: bad launch shape")
            dispatches.append(Dispatch(key, str(st["entry"]), bufs, [t for _, t in scalars], block, len(texts)))
            texts += [e for e, _ in scalars] + grid
        try:
            outputs = []
            for o in fp["outputs"]:
                dtype = np.dtype(str(o["dtype"]))
                if dtype.kind not in "biuf":
                    raise ValueError(f"output dtype {dtype}")
                outputs.append(Output(_ref(o["ref"], counts, f"plan {fname} output"),
                                      compile_many([str(d) for d in o["shape"]], names), dtype))
            fixed = fp.get("tokens", "n")
            fixed_tokens = None if fixed == "n" else int(fixed)
            evaluate = compile_many(texts, names)
        except KeyError as exc:
            raise PlanError(f"plan {fname}: missing field {exc}") from None
        except (TypeError, ValueError, PlanExprError) as exc:
            raise PlanError(f"plan {fname}: {exc}") from None
        if not outputs:
            raise PlanError(f"plan {fname}: no outputs")
        out[str(fname)] = FunctionPlan(str(fname), fixed_tokens, dispatches, evaluate, outputs)
    return out


# ---------------------------------------------------------------------------------------------
# the runner


class PlanRunner:
    """A loaded vulkan/metal artifact: `call(fn, tokens, pos)` runs one step, returns logits."""

    def __init__(self, root: Path, manifest: dict[str, Any], weights: list[np.ndarray], device: str) -> None:
        gpu = manifest.get("gpu") or {}
        if gpu.get("runtime") != "plan":
            raise PlanError(f"{root}: not a plan artifact (runtime {gpu.get('runtime')!r})")
        plan = read_plan(root / artifact_file(manifest, gpu.get("plan")))
        if plan.get("target") != manifest.get("target_key"):
            raise PlanError(f"{root}: plan for {plan.get('target')}, manifest says {manifest.get('target_key')}")
        try:
            check_layout_contract(manifest, plan.get("layout") or (), root)
        except ArtifactError as exc:
            raise PlanError(one_line(exc)) from None
        states = [(tuple(int(d) for d in s["shape"]), np.dtype(s["dtype"])) for s in manifest["states"]]
        kernel_text = (root / artifact_file(manifest, gpu.get("kernel_source"))).read_text(encoding="utf-8")
        self._setup(plan, kernel_text, weights, states, int(manifest["max_chunk"]), int(manifest["n_ctx"]), device,
                    int(gpu.get("storage_buffers", 8)))

    @classmethod
    def from_parts(cls, plan: dict[str, Any], kernel_text: str, weights: list[np.ndarray],
                   states: list[tuple[tuple[int, ...], Any]], max_chunk: int, n_ctx: int, device: str,
                   storage_buffers: int = 8, initial_states: list[np.ndarray] | None = None) -> PlanRunner:
        """A runner over an in-memory plan (tests, `ggufc verify`)."""
        self = cls.__new__(cls)
        self._setup(plan, kernel_text, weights, [(tuple(s), np.dtype(d)) for s, d in states], max_chunk, n_ctx,
                    device, storage_buffers)
        for buf, init in zip(self.buffers["state"], initial_states or [], strict=False):
            self.backend.write(buf, np.ascontiguousarray(init))
        return self

    def _setup(self, plan: dict[str, Any], kernel_text: str, weights: list[np.ndarray],
               states: list[tuple[tuple[int, ...], np.dtype[Any]]], max_chunk: int, n_ctx: int, device: str,
               storage_buffers: int) -> None:
        self.plan = plan
        self.max_chunk, self.n_ctx = max_chunk, n_ctx
        slots = plan.get("slots")
        if not isinstance(slots, list) or not all(type(s) is int and 0 <= s <= MAX_SLOT_BYTES for s in slots):
            raise PlanError("plan slots are malformed")
        consts = plan.get("consts") or []
        counts = {"param": len(weights), "state": len(states), "slot": len(slots), "const": len(consts)}
        self.functions = prepare_functions(plan, counts)
        if device == "vulkan":
            self.backend: Any = WgpuBackend(split_wgsl_bundle(kernel_text), storage_buffers=storage_buffers)
        elif device == "metal":
            self.backend = MetalBackend(kernel_text)
        else:
            raise PlanError(f"no plan backend for device '{device}'")
        be = self.backend
        self.state_bytes = [math.prod(s) * dt.itemsize for s, dt in states]
        self.buffers: dict[str, list[Any]] = {
            "state": [be.zeros(n) for n in self.state_bytes],
            "tokens": [be.zeros(max_chunk * 4)],
        }
        self._allocate(weights)

    def _allocate(self, weights: list[np.ndarray]) -> None:
        """Weights, intermediate slots and constants on the device; every dispatch's bindings."""
        be = self.backend
        self.buffers.update({
            "param": [be.upload(w) for w in weights],
            "slot": [be.zeros(b) for b in self.plan["slots"]],
            "const": [be.upload(np.asarray(c["values"], dtype=c["dtype"]).reshape(c["shape"]))
                      for c in self.plan.get("consts") or []],
        })
        self.sizes: dict[str, list[int]] = {k: [be.size(b) for b in v] for k, v in self.buffers.items()}
        self.prepared = {name: be.prepare(fp, self._buffer) for name, fp in self.functions.items()}

    def release(self, *, keep_states: bool) -> None:
        """Free the device buffers of weights, slots and constants (and states unless kept)."""
        self.prepared = {}
        for kind in ("param", "slot", "const", *(() if keep_states else ("state",))):
            for buf in self.buffers[kind]:
                self.backend.free(buf)
            self.buffers[kind] = []

    def restore(self, weights: list[np.ndarray], *, keep_states: bool) -> None:
        if not keep_states:
            self.buffers["state"] = [self.backend.zeros(n) for n in self.state_bytes]
        self._allocate(weights)

    def device_bytes(self) -> int:
        """Bytes of the device buffers held now (as the backend reports each buffer's size)."""
        return sum(self.backend.size(b) for bufs in self.buffers.values() for b in bufs)

    def _buffer(self, ref: tuple[str, int]) -> tuple[Any, int]:
        return self.buffers[ref[0]][ref[1]], self.sizes[ref[0]][ref[1]]

    def call_all(self, fn: str, tokens: np.ndarray, pos: int) -> list[np.ndarray]:
        """Run one step; every output of the function."""
        fp = self.functions[fn]
        n = int(tokens.size)
        if fp.fixed_tokens is not None and n != fp.fixed_tokens:
            raise PlanError(f"{fn} takes {fp.fixed_tokens} token(s), got {n}")
        if not 1 <= n <= self.max_chunk or pos < 0 or pos + n > self.n_ctx:
            raise PlanError(f"{fn}: {n} tokens at position {pos} do not fit (max_chunk {self.max_chunk}, "
                            f"n_ctx {self.n_ctx})")
        self.backend.write(self.buffers["tokens"][0], np.ascontiguousarray(tokens, dtype=np.int32))
        values = fp.evaluate(n, pos)
        self.backend.run(self.prepared[fn], fp, values)
        outs = []
        for o in fp.outputs:
            shape = tuple(int(d) for d in o.shape(n, pos))
            nbytes = math.prod(shape) * o.dtype.itemsize
            buf, size = self._buffer(o.ref)
            if nbytes > size:
                raise PlanError(f"{fn}: output of {nbytes} bytes exceeds its buffer ({size})")
            outs.append(self.backend.read(buf, nbytes).view(o.dtype).reshape(shape))
        return outs

    def call(self, fn: str, tokens: np.ndarray, pos: int) -> np.ndarray:
        return self.call_all(fn, tokens, pos)[0]

    def read_state(self, index: int) -> np.ndarray:
        return self.backend.read(self.buffers["state"][index], self.state_bytes[index])

    def write_state(self, index: int, value: np.ndarray) -> None:
        data = np.ascontiguousarray(value).view(np.uint8).reshape(-1)
        if data.nbytes != self.state_bytes[index]:
            raise PlanError(f"state {index} takes {self.state_bytes[index]} bytes, got {data.nbytes}")
        self.backend.write(self.buffers["state"][index], data)

    def move_cells(self, index: int, row_bytes: int, src: int, dst: int, rows: int, keep: tuple[int, int]) -> None:
        """State `index` as rows of `row_bytes`: rows [src, src + rows) moved to dst, and every row
        outside [keep[0], keep[1]) zeroed: on the device where the backend copies there (vulkan),
        else through the host."""
        n_rows = self.state_bytes[index] // row_bytes
        lo, hi = keep
        if hasattr(self.backend, "move"):
            clears = [(0, lo * row_bytes), (hi * row_bytes, (n_rows - hi) * row_bytes)]
            self.backend.move(self.buffers["state"][index], src * row_bytes, dst * row_bytes, rows * row_bytes, clears)
            return
        cells = self.read_state(index).reshape(n_rows, row_bytes)
        cells[dst : dst + rows] = cells[src : src + rows].copy()
        cells[:lo] = 0
        cells[hi:] = 0
        self.write_state(index, cells)

    def reset(self) -> None:
        for buf, nbytes in zip(self.buffers["state"], self.state_bytes, strict=True):
            self.backend.write(buf, np.zeros(nbytes, np.uint8))

    @property
    def description(self) -> str:
        return str(self.backend.description)
