"""Broken models: a missing, misshaped or unsupported tensor is named in one line, compile leaves
no artifact behind, and a good compile keeps the weights at their GGUF size."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufc.cli import main
from ggufc.frontend.gguf_file import open_gguf
from tests.support.fixtures import write_fixture

TARGET = "blk.0.attn_q.weight"
UNSUPPORTED = gguf.GGMLQuantizationType.IQ2_XS  # a 256-element block type ggufc does not read
NON_SQUARE = "blk.0.attn_k.weight"  # transposing it changes its shape


def rewrite(src: Path, dst: Path, *, drop: str | None = None, reshape: str | None = None,
            retype: str | None = None) -> Path:
    """Copy a GGUF file, dropping one tensor, transposing its shape, or storing it as IQ2_XS."""
    reader = gguf.GGUFReader(src)
    model = open_gguf(src)
    writer = gguf.GGUFWriter(dst, model.architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    for name, info in model.tensors.items():
        data = np.asarray(info.data)
        if name == drop:
            continue
        if name == reshape:
            writer.add_tensor(name, np.ascontiguousarray(data.reshape(info.shape).T))
        elif name == retype:
            n_bytes = info.n_elements // 256 * gguf.GGML_QUANT_SIZES[UNSUPPORTED][1]
            raw = np.zeros((info.shape[0], n_bytes // info.shape[0]), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=UNSUPPORTED)
        else:
            writer.add_tensor(name, data.reshape(info.shape) if info.qtype == "F32" else data,
                              raw_dtype=None if info.qtype == "F32" else gguf.GGMLQuantizationType[info.qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # rows of 256 so a 256-element block type can stand in for an unsupported type
    return write_fixture("llama", tmp_path_factory.mktemp("m") / "base.gguf", size="kquant")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"drop": TARGET}, f"missing tensor {TARGET}"),
        ({"reshape": NON_SQUARE}, f"tensor {NON_SQUARE} has shape"),
        ({"retype": TARGET}, f"tensor {TARGET} has type IQ2_XS"),
    ],
)
def test_broken_tensor_named_and_no_artifact(base: Path, tmp_path: Path, change: dict[str, str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    broken = rewrite(base, tmp_path / "broken.gguf", **change)
    out = tmp_path / "artifact"
    assert main(["compile", str(broken), "-o", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "Traceback" not in "\n".join(err)
    assert expected in err[-1]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".artifact")], "staging dir left behind"


def test_inspect_says_what_is_missing(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = rewrite(base, tmp_path / "broken.gguf", drop=TARGET)
    main(["inspect", str(broken)])
    assert f"missing tensor {TARGET}" in capsys.readouterr().out


def test_quantized_weights_keep_their_size(tmp_path: Path) -> None:
    model = write_fixture("llama", tmp_path / "q.gguf", size="kquant", qtype="Q4_K")
    out = tmp_path / "artifact"
    assert main(["compile", str(model), "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    gguf_bytes = manifest["gguf_tensor_bytes"]
    stored = manifest["weight_bytes"] - manifest["derived_bytes"]
    assert abs(stored - gguf_bytes) <= 0.10 * gguf_bytes
    assert {p["qtype"] for p in manifest["params"]} >= {"Q4_K"}
