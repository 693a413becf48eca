"""Codec names -> classes, and building a codec from a name or a job's compression spec."""

from __future__ import annotations

import inspect
from typing import Any

from hybridfleet.codec.base import Codec
from hybridfleet.codec.cast import Bf16Codec, Fp16Codec, NoneCodec
from hybridfleet.codec.frame import CODEC_IDS
from hybridfleet.codec.int4 import Int4Codec
from hybridfleet.codec.int8 import Int8Codec
from hybridfleet.codec.powersgd import PowerSGDCodec
from hybridfleet.codec.randomk import RandomKCodec
from hybridfleet.codec.rows import RowsCodec
from hybridfleet.codec.sign import SignCodec
from hybridfleet.codec.topk import TopKCodec

_CLASSES: dict[str, type[Codec]] = {
    cls.name: cls for cls in (NoneCodec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, RandomKCodec, SignCodec,
                Int4Codec, PowerSGDCodec, RowsCodec)
}
assert set(_CLASSES) == set(CODEC_IDS), "every codec needs a wire id in frame.CODEC_IDS"

# codecs the worker picks per block on its own, never a job's ps.compression.codec
WIRE_CODECS: tuple[str, ...] = ("rows",)
CODECS: tuple[str, ...] = tuple(name for name in CODEC_IDS if name not in WIRE_CODECS)
# codecs whose decode is the input exactly, in every input dtype
LOSSLESS_CODECS: tuple[str, ...] = ("none", "rows")
SPARSE_CODECS: tuple[str, ...] = tuple(name for name in CODECS if _CLASSES[name].sparse)


def codec_options(name: str) -> tuple[str, ...]:
    """The option names codec `name` accepts (ValueError for an unknown name)."""
    cls = _codec_class(name)
    parameters = inspect.signature(cls.__init__).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in parameters.items() if name != "self" and p.kind in named)


def get_codec(name: str, **options: Any) -> Codec:
    """A new codec `name` built with `options`.

    An unknown name or option is a ValueError that lists the valid ones.
    Decoding needs no options: every payload says how it was encoded, so a
    server may decode with `get_codec(name)`.
    """
    accepted = codec_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = ", ".join(accepted) or "none"
        raise ValueError(f"codec {name!r} takes no option {unknown[0]!r} (its options: {valid})")
    return _CLASSES[name](**options)


def codec_for(compression: Any) -> Codec:
    """The codec for a job's `ps.compression` spec (anything with `.codec` and `.ratio`).

    `ratio` (and `value_dtype`) go only to the codecs that keep a fraction of the elements,
    `rank` only to powersgd.
    """
    options = {}
    if compression.codec in SPARSE_CODECS:
        options = {"ratio": compression.ratio, "value_dtype": getattr(compression, "value_dtype", "float32")}
    elif compression.codec == "powersgd":
        options = {"rank": compression.rank}
    return get_codec(compression.codec, **options)


def _codec_class(name: str) -> type[Codec]:
    if name not in _CLASSES:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
    return _CLASSES[name]
