"""exaone4's keys and layers as llama.cpp reads them: window layers (and NoPE full layers) only at
64 layers, by a period of 4 or a per-layer pattern; MTP (nextn) blocks in a file are loaded and
not run.

The golden in all three feeding modes: tests/test_goldens.py; compiled against the interpreter on
the project's fixture: tests/test_models_compiled.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from ggufc.frontend.archs import exaone4
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import load_model
from tests.support.goldens import GOLDEN

FIXTURE = GOLDEN / "fixtures" / "exaone4-dense.gguf"


def _keys(n_layer: int, **extra: Any) -> Keys:
    base = {"embedding_length": 256, "attention.head_count": 2, "block_count": n_layer, "feed_forward_length": 384,
            "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 256, **extra}
    return Keys({f"exaone4.{k}": v for k, v in base.items()}, "exaone4")


def test_only_64_layers_have_window_layers_every_fourth_full_and_nope() -> None:
    hp = exaone4.read_hparams(_keys(64), 128)
    assert hp.window == 4096 and hp.swa == (True, True, True, False) * 16
    assert [hp.roped(il) for il in range(4)] == [True, True, True, False]
    small = exaone4.read_hparams(_keys(4, **{"attention.sliding_window": 32}), 128)
    assert small.window == 0 and not any(small.swa) and all(small.roped(il) for il in range(4))


def test_window_pattern_and_size_from_the_file() -> None:
    pattern = [il % 2 == 0 for il in range(64)]
    hp = exaone4.read_hparams(_keys(65, nextn_predict_layers=1, **{"attention.sliding_window": 8,
                                                                  "attention.sliding_window_pattern": pattern}), 128)
    assert (hp.n_layer, hp.n_layer_all, hp.window, hp.swa) == (64, 65, 8, tuple(pattern))


def test_nextn_layers_must_leave_a_trunk() -> None:
    with pytest.raises(ModelError, match="nextn_predict_layers"):
        exaone4.read_hparams(_keys(2, nextn_predict_layers=2), 128)


def _with_mtp_block(tmp: Path) -> Path:
    """The golden fixture plus one nextn block (a copy of layer 1 and the nextn tensors)."""
    src = gguf.GGUFReader(FIXTURE)
    out = tmp / "exaone4-mtp.gguf"
    w = gguf.GGUFWriter(out, "exaone4")
    for name, field in src.fields.items():
        value: Any = field.contents()
        if name.startswith("GGUF.") or name == "general.architecture" or value == []:
            continue
        if name == "exaone4.block_count":
            value = 3
        elif name == "exaone4.nextn_predict_layers":
            value = 1
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, field.types[0], sub_type=sub)
    n_embd = 256
    extra = {t.name.replace("blk.1.", "blk.2."): np.array(t.data) for t in src.tensors if t.name.startswith("blk.1.")}
    extra |= {"blk.2.nextn.eh_proj.weight": np.zeros((n_embd, 2 * n_embd), np.float32),
              "blk.2.nextn.enorm.weight": np.ones(n_embd, np.float32),
              "blk.2.nextn.hnorm.weight": np.ones(n_embd, np.float32)}
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data))
    for name, data in extra.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.skipif(not FIXTURE.is_file(), reason=f"llama.cpp goldens not found at {GOLDEN}")
def test_mtp_block_is_loaded_and_not_run(tmp_path: Path) -> None:
    plain, mtp = load_model(FIXTURE), load_model(_with_mtp_block(tmp_path))
    assert mtp.gguf.metadata["exaone4.block_count"] == 3 and mtp.hparams.n_layer == 2
    assert any(name.startswith("blk.2.") for name in mtp.gguf.tensors)

    def ops(model: Any) -> list[tuple[str, list[str]]]:
        return [(node.op, [v.name for v in node.outputs]) for node in model.graph.nodes]

    assert ops(mtp) == ops(plain)
