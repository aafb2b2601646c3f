"""What the sparse-attention architectures' tests check alike, one row per architecture
(tests/support/arch_models.py `SPARSE_GOLDENS`): llama.cpp's sparse golden (the dense golden with a
lower indexer.top_k) through the compiled kernels in all three feeding modes, and the named fusions on
the dense golden, the sparse one and the project's fixture (fused = unfused = decomposed, each
switchable off, each recognising its own decomposition).

An architecture's own file keeps what is particular to it: its hyper-parameters, the fused ops and hit
counts it expects (test_fusion_hits_and_fused_ops), its selections, its refusals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.frontend.load import LoadedModel, load_model
from tests.support import sparse_indexers as SP
from tests.support.arch_models import SPARSE_GOLDENS, SparseGolden
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.sparse_indexers import Compiled, compile_probed, nmse

MODES = {64: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}
CASES = [(arch, case) for arch, row in SPARSE_GOLDENS.items() for case in row.cases]


class Models:
    """Each row's models, loaded (or compiled) once for the module."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.loaded: dict[tuple[str, str], LoadedModel] = {}
        self.compiled: dict[str, Compiled] = {}

    def model(self, arch: str, case: str) -> LoadedModel:
        """The fusion case `case` of `arch`: a golden by name, or "project"."""
        row = SPARSE_GOLDENS[arch]
        if (arch, case) not in self.loaded:
            self.loaded[arch, case] = self._load(row, case)
        return self.loaded[arch, case]

    def _load(self, row: SparseGolden, case: str) -> LoadedModel:
        if case == "project":
            return row.project(self.folder / row.arch)
        if not row.dense_path.exists():
            pytest.skip("llama.cpp goldens absent")
        if case == row.sparse:
            return load_model(row.sparse_copy(self.folder))
        return load_model(row.dense_path)

    def compiled_sparse(self, arch: str) -> Compiled:
        if arch not in self.compiled:
            self.compiled[arch] = compile_probed(self.model(arch, SPARSE_GOLDENS[arch].sparse))
        return self.compiled[arch]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    folder = tmp_path_factory.mktemp("sparse-architectures")
    for arch in SPARSE_GOLDENS:
        (folder / arch).mkdir()
    return Models(folder)


def _case_id(case: tuple[str, str]) -> str:
    arch, name = case
    return f"{arch}-project" if name == "project" else name


@skip_without_goldens()
@pytest.mark.parametrize("chunk", list(MODES))
@pytest.mark.parametrize("arch", list(SPARSE_GOLDENS))
def test_compiled_sparse_matches_llama_cpp_sparse(models: Models, arch: str, chunk: int) -> None:
    """Closer to llama.cpp's sparse logits than llama.cpp's own dense logits are, by the row's factor.
    Measured: qwen4exp (top_k 4) about 5e-14 against a dense-vs-sparse gap of 1.5e-7; minimax-m3
    (top_k 2 blocks) 4.7e-11 one-shot, 4.8e-11 in chunks of 7 and in decode, against a gap of 5.6e-6."""
    row = SPARSE_GOLDENS[arch]
    sparse = np.load(GOLDEN / "logits" / f"{row.sparse}.npz")
    dense = np.load(GOLDEN / "logits" / f"{row.dense}.npz")
    (logits,) = models.compiled_sparse(arch).run(sparse["tokens"], chunk)
    err = nmse(logits, sparse[MODES[chunk]])
    gap = nmse(dense[MODES[chunk]], sparse[MODES[chunk]])
    assert err < 1e-6 and gap / err >= row.closer_by, f"NMSE {err:.3g}, dense-vs-sparse gap {gap:.3g}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_and_decomposed_match_unfused(models: Models, case: tuple[str, str]) -> None:
    row, model = SPARSE_GOLDENS[case[0]], models.model(*case)
    spelled = row.spelled(model.graph) if row.spelled else None
    SP.check_fused_and_decomposed_match_unfused(model, row.case_tokens(case[1], model), spelled)


SWITCHES = [(arch, case, off) for arch, case in CASES for off in sorted(SPARSE_GOLDENS[arch].fusions[case])]


@pytest.mark.parametrize(("arch", "case", "off"), SWITCHES,
                         ids=[f"{_case_id((a, c))}-{off}" for a, c, off in SWITCHES])
def test_each_named_fusion_switches_off(models: Models, arch: str, case: str, off: str) -> None:
    model = models.model(arch, case)
    SP.check_fusion_switches_off(model, SPARSE_GOLDENS[arch].case_tokens(case, model), off)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fusions_recognise_the_decompositions(models: Models, case: tuple[str, str]) -> None:
    SP.check_fusions_recognise_decompositions(models.model(*case), set(SPARSE_GOLDENS[case[0]].fused_ops))
