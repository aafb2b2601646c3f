"""The table of every block format ggufc reads, by GGUF type name.
"""

from __future__ import annotations

from ggufc.codegen.formats.block32_formats import BLOCK32_FORMATS
from ggufc.codegen.formats.float_formats import FLOAT_FORMATS
from ggufc.codegen.formats.format_spec import QFormat
from ggufc.codegen.formats.kquant_formats import KQUANT_FORMATS
from ggufc.codegen.formats.lookup_formats import LOOKUP_FORMATS

FORMATS: dict[str, QFormat] = {**FLOAT_FORMATS, **BLOCK32_FORMATS, **KQUANT_FORMATS, **LOOKUP_FORMATS}


QTYPES: tuple[str, ...] = tuple(FORMATS)


def get_format(qtype: str) -> QFormat:
    try:
        return FORMATS[qtype]
    except KeyError:
        have = ", ".join(QTYPES)
        raise NotImplementedError(f"quantisation type {qtype!r} is not supported (have {have})") from None
