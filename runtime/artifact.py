"""The compiled-model artifact format, shared by the writer (artifact_writer.py), the reader
(artifact_reader.py) and codegen.

An artifact is a directory (or a `.tar` of one) holding

- `manifest.json`: what was compiled, for which target, the calling convention, the params and
  states layout, and the sha256 of every other file;
- `manifest.sha256`: the sha256 of `manifest.json` itself, so no file goes unchecked;
- `kernels.so`: a TVM Relax VM executable (`export_library`);
- `weights.safetensors`: the params in the layout the kernels read;
- optionally `tokenizer.json`.

Here: the file names, the manifest's required fields, the layout contract compiled into the
kernels, and the 64-byte-aligned buffers the kernels read. Nothing here imports the compiler
(frontend/passes/codegen): an artifact runs with the runtime and TVM's runtime alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ggufc.messages import GgufcError, shorten

FORMAT_VERSION = 3  # 2: manifest digest file, layout contract compiled into the kernels; 3: CPU
# entry points take each weight array as an argument
MANIFEST_NAME = "manifest.json"
MANIFEST_DIGEST_NAME = "manifest.sha256"
SEAL_FILES = (MANIFEST_NAME, MANIFEST_DIGEST_NAME)  # the files that seal an artifact, not listed in it
LAYOUT_FUNCTION = "ggufc_layout"  # a kernels function returning the layout contract it was built for
KERNELS_NAME = "kernels.so"
WEIGHTS_NAME = "weights.safetensors"
ALIGN = 64  # vectorised TVM kernels segfault on buffers that are not 64-byte aligned
MAX_ARRAY_DIMS = 8
MAX_ARRAY_BYTES = 1 << 46  # no array a manifest describes can be larger than this (64 TiB)

# Fields codegen must provide; finalize_artifact and load_manifest both check them.
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "arch": str,
    "hparams": dict,
    "n_ctx": int,
    "n_vocab": int,
    "target": dict,
    "target_key": str,
    "functions": dict,
    "max_chunk": int,
    "params": list,
    "states": list,
}
FIELDS_ADDED_HERE = ("format_version", "ggufc_version", "files")


# How the runtime truncates each state (runtime/context.py); absent means recurrent.
STATE_KINDS = ("per_position", "recurrent", "scratch")
WINDOW_KIND = "window"  # a sliding-window layer's K/V cache of a few cells (WindowCells)
KNOWN_STATE_KINDS = (*STATE_KINDS, WINDOW_KIND)
WINDOW_STEP_QUANTUM = 32  # the CPU attention kernel's accumulators take cell s into s % 32


@dataclass(frozen=True)
class WindowCells:
    """How a sliding-window layer's K/V cache keeps only the cells its window can still read.

    A query at position p sees positions p - size < j <= p. The cache holds position j at cell
    j - shift(p) during a call at position p, where shift(p) is the largest multiple of `step`
    at or below p - (size - 1) - margin (0 before that): the window's cells plus `margin` more
    (a cut back by up to `margin` tokens is a move of cells, no compute). The kernels compute
    shift(p) themselves from the call's position; after a call the runtime moves the cells to
    shift(n_past), the layout the next call expects. `step` is a multiple of 32 so that every
    cell keeps its place in the kernel's 32 accumulators: the sums, and so the logits, are those
    of a full cache bit for bit. `cells()` is enough for a chunk of max_chunk tokens at any p.
    """

    size: int
    margin: int
    step: int

    @classmethod
    def for_window(cls, size: int) -> WindowCells:
        """Margin and step half the window, in whole 32-cell steps: cells move once every step
        tokens (size + margin of them), about 3 cells per token."""
        half = -(-size // (2 * WINDOW_STEP_QUANTUM)) * WINDOW_STEP_QUANTUM
        return cls(size, half, half)

    def shift(self, pos: int) -> int:
        """The position cell 0 holds during a call at `pos` (and after a context of `pos` tokens)."""
        return max(0, (pos - (self.size - 1) - self.margin) // self.step * self.step)

    def cells(self, max_chunk: int) -> int:
        """Cells a call of up to max_chunk tokens at any position writes or reads."""
        return self.size - 1 + self.margin + self.step + max_chunk - 1

    def as_json(self) -> dict[str, int]:
        return {"size": self.size, "margin": self.margin, "step": self.step}

    @classmethod
    def from_state(cls, state: dict[str, Any], max_chunk: int, where: str) -> WindowCells:
        """A manifest state's window, checked against its shape (an ArtifactError otherwise)."""
        raw: Any = state.get("window")
        name = str(state.get("name"))[:40]
        try:
            window = cls(int(raw["size"]), int(raw["margin"]), int(raw["step"]))
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{where}: window state {name!r} has no valid 'window' field") from None
        ok = window.size > 0 and window.margin >= 0 and window.step > 0 and window.step % WINDOW_STEP_QUANTUM == 0
        shape = state.get("shape")
        if not ok or not isinstance(shape, list) or not shape or shape[0] < window.cells(max_chunk):
            raise ArtifactError(f"{where}: window state {name!r} has an invalid window {raw!r:.80} for its shape")
        return window


class ArtifactError(GgufcError, ValueError):
    """An artifact that cannot be written or used; the message is one line naming the problem."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (many libraries raise multi-line ones), shortened
    at a word; ggufc's own errors are kept whole (their hints come last)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return lines[0] if isinstance(exc, GgufcError) else shorten(lines[0], limit)


def aligned_empty(shape: tuple[int, ...] | list[int] | int, dtype: npt.DTypeLike) -> np.ndarray:
    """Uninitialised C-contiguous array whose data pointer is a multiple of 64 bytes."""
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset : offset + nbytes].view(dt).reshape(dims)


def aligned_zeros(shape: tuple[int, ...] | list[int] | int, dtype: npt.DTypeLike) -> np.ndarray:
    out = aligned_empty(shape, dtype)
    out[...] = 0
    return out


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so large weights never sit in memory twice."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def layout_contract(manifest: dict[str, Any]) -> tuple[int, ...]:
    """Four int64 words of the sha256 of every manifest value that sizes what kernels touch.

    Codegen compiles these words into the kernels (a `ggufc_layout` function, or the dispatch
    plan); the runtime recomputes them from the manifest before any kernel runs, so a manifest
    whose context, chunk size, vocabulary, states or weight shapes differ from what the kernels
    were built for is refused instead of reaching native code.
    """
    fields = {
        "n_ctx": manifest.get("n_ctx"),
        "n_vocab": manifest.get("n_vocab"),
        "max_chunk": manifest.get("max_chunk"),
        "states": [[s.get("shape"), s.get("dtype"), *([s["window"]] if "window" in s else [])]
                   for s in manifest.get("states", []) if isinstance(s, dict)],
        "params": [
            [[a.get("shape"), a.get("dtype")] for a in p.get("arrays", []) if isinstance(a, dict)]
            for p in manifest.get("params", [])
            if isinstance(p, dict)
        ],
    }
    try:
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"manifest layout is not plain JSON data ({one_line(exc)})") from None
    return tuple(int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8))


def check_layout_contract(manifest: dict[str, Any], compiled: Any, where: str | os.PathLike[str]) -> None:
    """Refuse a manifest that does not describe the layout the kernels were compiled for."""
    try:
        words = tuple(int(w) for w in compiled)
    except (TypeError, ValueError):
        words = ()
    if words != layout_contract(manifest):
        raise ArtifactError(
            f"{where}: manifest does not match the layout the kernels were compiled for "
            "(n_ctx, max_chunk, n_vocab, states or weight shapes edited); recompile the model"
        )


def check_fields(manifest: dict[str, Any], where: str) -> None:
    """REQUIRED_FIELDS and the params' and states' layouts, as sealing and reading both check them."""
    for name, kind in REQUIRED_FIELDS.items():
        value = manifest.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ArtifactError(f"{where}: manifest field '{name}' is missing or not a {_kind_name(kind)}")
    for name in ("n_ctx", "n_vocab", "max_chunk"):
        if manifest[name] <= 0:
            raise ArtifactError(f"{where}: manifest field '{name}' must be positive, got {manifest[name]}")
    if not manifest["functions"]:
        raise ArtifactError(f"{where}: manifest lists no functions")
    ubatch = manifest.get("ubatch", manifest["max_chunk"])
    if not isinstance(ubatch, int) or isinstance(ubatch, bool) or not 0 < ubatch <= manifest["max_chunk"]:
        raise ArtifactError(f"{where}: manifest field 'ubatch' must be a token count in [1, max_chunk], "
                            f"got {ubatch!r:.40}")
    for param in manifest["params"]:
        arrays = param.get("arrays") if isinstance(param, dict) else None
        if not isinstance(arrays, list) or not all(isinstance(a, dict) and "key" in a for a in arrays):
            raise ArtifactError(f"{where}: manifest param {param!r:.80} has no valid 'arrays' list")
        for spec in arrays:
            array_layout(spec)
    for state in manifest["states"]:
        if not isinstance(state, dict):
            raise ArtifactError(f"{where}: manifest state {state!r:.80} is not an object")
        array_layout(state)
        if state.get("kind", STATE_KINDS[1]) not in KNOWN_STATE_KINDS:
            raise ArtifactError(f"{where}: manifest state {str(state.get('name'))!r:.40} has unknown kind "
                                f"{state.get('kind')!r:.40} (known: {', '.join(KNOWN_STATE_KINDS)})")
        if state.get("kind") == WINDOW_KIND:
            WindowCells.from_state(state, manifest["max_chunk"], where)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def referenced_files(manifest: dict[str, Any]) -> list[str]:
    """Files the runtime will open: each must be listed, with a matching hash."""
    kernel_files = manifest.get("kernel_files")  # GPU targets: plan + WGSL/MSL, or kernels.so + fatbin
    refs = [] if manifest.get("target_key") in ("vulkan", "metal") else [KERNELS_NAME]  # VM targets: always
    if isinstance(kernel_files, list) and all(isinstance(f, str) for f in kernel_files):
        refs += [f for f in kernel_files if f not in refs]
    if not refs:
        refs = [KERNELS_NAME]
    refs.append(WEIGHTS_NAME)
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict) and tok.get("file"):
        refs.append(str(tok["file"]))
    return refs


def array_layout(spec: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """(shape, dtype) of a manifest array or state entry."""
    try:
        shape, dtype = tuple(int(d) for d in spec["shape"]), np.dtype(spec["dtype"])
    except (KeyError, TypeError, ValueError) as exc:
        reason = one_line(exc)
        raise ArtifactError(f"manifest array {spec!r:.80} has no valid shape/dtype ({reason})") from None
    # Plain numbers only (an object dtype would read pointers out of the weights file), and a
    # size that can exist: the arena is allocated from these before any weight is read.
    if dtype.kind not in "biuf" or len(shape) > MAX_ARRAY_DIMS or any(d < 0 for d in shape):
        raise ArtifactError(f"manifest array {spec!r:.80} has an unsupported shape/dtype")
    if math.prod(shape) * dtype.itemsize > MAX_ARRAY_BYTES:
        raise ArtifactError(f"manifest array {spec!r:.80} claims more than {MAX_ARRAY_BYTES} bytes")
    return shape, dtype
