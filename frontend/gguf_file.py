"""Open a GGUF file with the `gguf` package (memory-mapped) and expose plain Python values.

Everything downstream sees `GGUFModel`: metadata as Python scalars/lists/strings and tensors as
raw, memory-mapped byte rows in their GGUF block format. Nothing is dequantised here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import gguf.gguf_reader
import numpy as np

from .gguf_validate import GGUFError, validate_gguf


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: str  # GGML type name: "F32", "Q4_K", ...
    shape: tuple[int, ...]  # numpy order (slowest first), i.e. GGUF ne reversed
    data: np.ndarray  # raw storage: float arrays for F32/F16/BF16(uint16)... or uint8 block rows
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class GGUFModel:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(name, default)


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def open_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Read metadata and tensor directory; tensor data stays memory-mapped.

    The file is first checked by `gguf_validate` (bounded, every length against the file size),
    so `gguf.GGUFReader`, which trusts what it reads, only ever sees a well-formed file.
    """

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    validate_gguf(path)
    try:
        with _plain_ndarray_memmap():
            reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the validator should have caught it; still report one line
        raise GGUFError(f"{path}: malformed GGUF ({type(exc).__name__}: {_one_line(exc)})") from None
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = _field_value(field)
        except Exception as exc:  # e.g. an array of strings that is not UTF-8
            raise GGUFError(f"{path}: malformed GGUF: key {name!r:.80}: {_one_line(exc)}") from None
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        tensors[t.name] = TensorInfo(
            name=t.name,
            qtype=t.tensor_type.name,
            shape=shape,
            data=t.data,
            n_bytes=int(t.n_bytes),
        )
    return GGUFModel(path=path, metadata=metadata, tensors=tensors)


@contextlib.contextmanager
def _plain_ndarray_memmap() -> Iterator[None]:
    """Let GGUFReader slice a plain ndarray view of its memory map.

    Every slice of an `np.memmap` runs memmap's `__array_finalize__`; the reader makes hundreds
    of thousands of tiny slices for a 50k-token vocabulary, which costs seconds. A plain ndarray
    view of the same mapping reads the same bytes, still lazily from the page cache.
    """
    module = gguf.gguf_reader.np
    original = module.memmap

    def plain(*args: Any, **kwargs: Any) -> np.ndarray:
        return original(*args, **kwargs).view(np.ndarray)

    module.memmap = plain  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        module.memmap = original  # type: ignore[assignment,misc]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
