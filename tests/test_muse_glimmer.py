"""muse-glimmer's keys as llama.cpp reads them: the window pattern (a period of 4 by default), rope
only on window layers with their own base and no scaling, the final softcap 30 when the file sets
none, the logits multiplied by logit_scale before the softcap.

The golden in all three feeding modes: tests/test_goldens.py; compiled against the interpreter on
the project's fixture (logit_scale 1.5, windows of 4): tests/test_models_compiled.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.frontend.archs import muse_glimmer
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import load_model
from tests.support.goldens import GOLDEN, with_metadata

FIXTURE = GOLDEN / "fixtures" / "muse-glimmer-dense.gguf"


def _keys(**extra: Any) -> Keys:
    base = {"embedding_length": 256, "attention.head_count": 4, "block_count": 8, "feed_forward_length": 384,
            "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 256, "attention.sliding_window": 32,
            "logit_scale": 1.0, "rope.freq_base": 1e6, **extra}
    return Keys({f"muse-glimmer.{k}": v for k, v in base.items()}, "muse-glimmer")


def test_defaults_period_4_model_base_on_window_layers_softcap_30() -> None:
    hp = muse_glimmer.read_hparams(_keys(**{"rope.scaling.factor": 4.0}), 128)
    assert hp.swa == (True, True, True, False) * 2 and hp.window == 32
    assert (hp.rope_base_swa, hp.final_softcap, hp.logit_multiplier) == (1e6, 30.0, 0.0)


def test_window_base_softcap_and_logit_scale_from_the_file() -> None:
    hp = muse_glimmer.read_hparams(_keys(**{"rope.freq_base_swa": 5e4, "final_logit_softcapping": 0.0,
                                            "logit_scale": 0.3, "attention.sliding_window_pattern": 2}), 128)
    assert hp.swa == (True, False) * 4
    assert (hp.rope_base_swa, hp.final_softcap, hp.logit_multiplier) == (5e4, 0.0, float(np.float32(0.3)))


@pytest.mark.parametrize(("key", "message"), [("attention.sliding_window", "sliding_window"),
                                              ("logit_scale", "logit_scale")])
def test_required_keys(key: str, message: str) -> None:
    keys = _keys()
    del keys.metadata[f"muse-glimmer.{key}"]
    with pytest.raises(ModelError, match=message):
        muse_glimmer.read_hparams(keys, 128)


def _copy_with(tmp: Path, key: str, value: str) -> Path:
    return with_metadata(FIXTURE, tmp / "muse-glimmer-dense.gguf", {key: value})


@pytest.mark.skipif(not FIXTURE.is_file(), reason=f"llama.cpp goldens not found at {GOLDEN}")
def test_only_the_window_layer_is_roped_and_logits_are_scaled_then_capped(tmp_path: Path) -> None:
    model = load_model(_copy_with(tmp_path, "muse-glimmer.logit_scale", "2"))
    assert model.hparams.swa == (False, True)
    ropes = [node for node in model.graph.nodes if node.op == "rope"]
    assert len(ropes) == 2  # q and k of layer 1 only
    tail = [(node.op, [v.name for v in node.outputs]) for node in model.graph.nodes[-4:]]
    assert tail == [("scalar", ["result_output_scaled"]), ("scalar", ["result_output.scaled"]),
                    ("unary", ["result_output.tanh"]), ("scalar", ["result_output"])]
    assert model.graph.nodes[-4].attrs.c == 2.0
