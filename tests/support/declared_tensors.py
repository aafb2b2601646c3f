"""The tensors an architecture file declares, found by running it.

`declared_tensors` runs the architecture's `read_hparams` and `build` against a weight source that
holds no file: every `need`, every `get` of a tensor the caller says is present and every
`int_table` is answered with a placeholder of the asked shape and recorded. The fixture writer
writes exactly these, so a tensor's name and shape are written down once, in the architecture file.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggufc.frontend.archs import ARCHITECTURES
from ggufc.frontend.blocks import Weights
from ggufc.frontend.gguf_file import GGUFModel, TensorInfo
from ggufc.frontend.hparams import Keys
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Shape, Value

Presence = Callable[[str, Collection[str]], bool]


@dataclass(frozen=True)
class Declared:
    name: str
    shape: tuple[int, ...]  # numpy order
    required: bool
    qtype: str | None  # "F32" where the architecture reads only F32, "I32" for integer tables, else None


class DeclaringWeights(Weights):
    """A weight source without a file: `present(name, read)` says which optional tensors (and which
    of the layouts an architecture probes with `has`) the model has, `read` being the tensors read
    so far; every tensor read is recorded."""

    def __init__(self, arch: str, present: Presence) -> None:
        super().__init__(GGUFModel(f"<declared {arch}>", {"general.architecture": arch}, {}), GraphBuilder())
        self.present = present
        self.declared: dict[str, Declared] = {}
        self.absent: set[str] = set()  # optional tensors read and answered "not in this model"

    def has(self, name: str) -> bool:
        return name in self.model.tensors or self.present(name, self.model.tensors.keys())

    def get(self, name: str, shape: Shape, *, required: bool = True, f32: bool = False) -> Value | None:
        if not required and name not in self.model.tensors and not self.present(name, self.model.tensors.keys()):
            self.absent.add(name)
            return None
        self._declare(name, shape, required, "F32" if f32 else None, np.ones(_dims(shape), np.float32))
        self.used.add(name)
        return self.b.param(name, tuple(shape), "F32")

    def int_table(self, name: str, shape: Shape, user: str) -> np.ndarray:
        rows, cols = _dims(shape)
        self._declare(name, shape, True, "I32", np.tile(np.arange(cols, dtype=np.int32), (rows, 1)))
        return super().int_table(name, shape, user)

    def check_all_used(self) -> None:
        """Nothing to check: the model holds exactly what was read."""

    def _declare(self, name: str, shape: Shape, required: bool, qtype: str | None, data: np.ndarray) -> None:
        dims = _dims(shape)
        seen = self.declared.get(name)
        if seen is not None and seen.shape != dims:
            raise ValueError(f"{name} is read as {list(seen.shape)} and as {list(dims)}")
        if seen is None:
            self.declared[name] = Declared(name, dims, required, qtype)
            self.model.tensors[name] = TensorInfo(name, qtype or "F32", dims, data, data.nbytes)


def _dims(shape: Shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


@dataclass(frozen=True)
class ArchTensors:
    tensors: list[Declared]  # in the order the architecture reads them
    absent: frozenset[str]  # the optional tensors it would have read, had `present` said so


def declared_tensors(arch: str, metadata: dict[str, Any], n_vocab: int, present: Presence) -> ArchTensors:
    """Every tensor `arch` reads from a model with these keys."""
    module = ARCHITECTURES[arch]
    hp = module.read_hparams(Keys(metadata, arch), n_vocab)
    w = DeclaringWeights(arch, present)
    module.build(w, hp, hp.n_ctx_train, True)
    return ArchTensors(list(w.declared.values()), frozenset(w.absent))
