"""granite's keys as llama.cpp reads them, on copies of llama.cpp's fixtures with one key changed:
`rope.scaling.finetuned` false makes granite NoPE on every layer and is ignored by granitemoe; the
logit scale is a multiply by its float32 reciprocal and may not be 0; granite_swa windows the layers
its pattern marks, puts sinks on every layer and ropes by `attention.rope_pattern`.

The goldens in all three feeding modes: tests/test_goldens.py; compiled against the interpreter on
the project's fixture with every multiplier set: tests/test_models_compiled.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.frontend.archs import granite_swa
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import LoadedModel, load_model
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata

pytestmark = skip_without_goldens()


def _copy_with(tmp: Path, name: str, key: str, value: str) -> Path:
    return with_metadata(GOLDEN / "fixtures" / f"{name}.gguf", tmp / f"{name}.gguf", {key: value})


def _rope_ops(model: LoadedModel) -> int:
    return sum(node.op == "rope" for node in model.graph.nodes)


def test_granite_not_finetuned_ropes_no_layer(tmp_path: Path) -> None:
    roped = load_model(GOLDEN / "fixtures" / "granite-dense.gguf")
    # gguf_set_metadata makes a bool of the string: only the empty one is false
    nope = load_model(_copy_with(tmp_path, "granite-dense", "granite.rope.scaling.finetuned", ""))
    assert nope.gguf.metadata["granite.rope.scaling.finetuned"] is False and not nope.hparams.rope
    assert _rope_ops(roped) == 2 * roped.hparams.n_layer
    assert _rope_ops(nope) == 0


def test_granitemoe_ignores_finetuned() -> None:
    model = load_model(GOLDEN / "fixtures" / "granitemoe-moe.gguf")  # llama.cpp wrote finetuned = false
    assert model.gguf.metadata["granitemoe.rope.scaling.finetuned"] is False
    assert _rope_ops(model) == 2 * model.hparams.n_layer


def test_logit_scale_is_a_float32_reciprocal_multiply(tmp_path: Path) -> None:
    model = load_model(_copy_with(tmp_path, "granite-dense", "granite.logit_scale", "3"))
    assert model.hparams.logit_multiplier == float(np.float32(1) / np.float32(3))
    last = model.graph.nodes[-1]
    assert (last.op, last.attrs.fn, last.attrs.c) == ("scalar", "mul", model.hparams.logit_multiplier)
    assert [v.name for v in last.outputs] == [v.name for v in model.graph.outputs] == ["result_output"]


def test_zero_logit_scale_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="logit_scale must not be 0"):
        load_model(_copy_with(tmp_path, "granite-dense", "granite.logit_scale", "0"))


def _attention_attrs(model: LoadedModel) -> list[tuple[int, bool]]:
    return [(node.attrs.window, node.attrs.sinks) for node in model.graph.nodes if node.op == "attention"]


def test_granite_swa_windows_and_sinks_follow_the_pattern() -> None:
    model = load_model(GOLDEN / "fixtures" / "granite_swa-dense.gguf")  # pattern [0, 1], window 32, rope_pattern 1
    assert _attention_attrs(model) == [(0, True), (32, True)]
    assert model.hparams.roped == (True, True) and _rope_ops(model) == 2 * model.hparams.n_layer


def test_granite_swa_scalar_rope_pattern_0_ropes_no_layer(tmp_path: Path) -> None:
    model = load_model(_copy_with(tmp_path, "granite_swa-dense", "granite_swa.attention.rope_pattern", "0"))
    assert model.hparams.roped == (False, False) and _rope_ops(model) == 0


@pytest.mark.parametrize(("pattern", "message"), [
    (None, "as a per-layer array"), (2, "as a per-layer array"), ([1, 0, 1], "has 3 entries, expected 2"),
])
def test_granite_swa_window_pattern_must_be_a_per_layer_array(pattern: object, message: str) -> None:
    key = "granite_swa.attention.sliding_window_pattern"
    keys = Keys({} if pattern is None else {key: pattern}, "granite_swa")
    with pytest.raises(ModelError, match=message):
        granite_swa._per_layer(keys, "attention.sliding_window_pattern", 2, None)
