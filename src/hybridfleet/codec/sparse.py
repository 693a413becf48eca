"""Shared machinery of the sparsifying codecs (top-k, random-k).

A sparse payload carries k = ceil(ratio * numel) coordinates: params (k as
uint32, index coding as uint8), the sorted indices (see `indices.py`) and the
values, float32 or (``value_dtype="float16"``) float16; the values field's
length tells which, so decoding needs no option. `decode_sparse` hands them out without densifying, so a
server can aggregate updates coordinate-wise.
"""

from __future__ import annotations

import copy
import math
import struct
from abc import abstractmethod

import numpy as np

from hybridfleet.codec.base import Codec
from hybridfleet.codec.frame import Frame
from hybridfleet.codec.indices import CODING_IDS, decode_indices, encode_indices, smaller_coding
from hybridfleet.errors import ProtocolError

_PARAMS = struct.Struct("<IB")  # k, index coding
INDEX_CODINGS = ("auto", *CODING_IDS)
VALUE_DTYPES = {"float32": "<f4", "float16": "<f2"}
_F16_MAX = float(np.finfo(np.float16).max)


def kept_count(ratio: float, numel: int) -> int:
    """k = ceil(ratio * numel), at least 1 for a non-empty tensor.

    A product within 1e-6 of an integer counts as that integer, so float noise
    (0.07 * 100 = 7.000000000000001) does not keep one element too many.
    """
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel - 1e-6)))


def check_ratio(ratio: float, codec_name: str) -> float:
    """`ratio` as a float if it is in (0, 1]; ValueError naming the codec otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)) or not 0 < ratio <= 1:
        raise ValueError(f"{codec_name}: ratio must be a number in (0, 1] (got {ratio!r})")
    return float(ratio)


class SparseCodec(Codec):
    """Base of codecs that send a subset of coordinates; subclasses choose the subset."""

    sparse = True
    num_fields = 3

    def __init__(self, ratio: float = 0.01, index_coding: str = "auto", value_dtype: str = "float32"):
        self.ratio = check_ratio(ratio, self.name)
        if index_coding not in INDEX_CODINGS:
            raise ValueError(f"{self.name}: index_coding must be one of {', '.join(INDEX_CODINGS)} (got {index_coding!r})")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"{self.name}: value_dtype must be one of {', '.join(VALUE_DTYPES)} (got {value_dtype!r})")
        self.index_coding = index_coding
        self.value_dtype = value_dtype

    def options(self) -> dict:
        return {"ratio": self.ratio, "index_coding": self.index_coding, "value_dtype": self.value_dtype}

    def with_ratio(self, ratio: float) -> "SparseCodec":
        """A copy of this codec keeping `ratio` of the elements (shares any random state)."""
        clone = copy.copy(self)
        clone.ratio = check_ratio(ratio, self.name)
        return clone

    @abstractmethod
    def _select(self, flat: np.ndarray, k: int) -> np.ndarray:
        """k distinct int64 indices into `flat`, sorted increasing."""

    def _values(self, flat: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return flat[indices]

    def _encode_fields(self, flat: np.ndarray) -> list:
        k = kept_count(self.ratio, flat.size)
        indices = self._select(flat, k)
        coding = smaller_coding(indices) if self.index_coding == "auto" else CODING_IDS[self.index_coding]
        values = self._values(flat, indices).astype("<f4", copy=False)
        if self.value_dtype == "float16":  # saturate rather than overflow to Inf
            values = np.clip(values, -_F16_MAX, _F16_MAX).astype("<f2")
        return [_PARAMS.pack(k, coding), encode_indices(indices, coding), values]

    def _decode_sparse_fields(self, frame: Frame) -> tuple[np.ndarray, np.ndarray]:
        k, coding = frame.params(0, _PARAMS, "params")
        numel = frame.header.numel
        if k > numel:
            raise ProtocolError(f"{self.name} payload announces {k} values for a tensor of {numel} elements")
        raw_indices = np.frombuffer(frame.fields[1], dtype=np.uint8)
        indices = decode_indices(raw_indices, coding, k, numel, self.name)
        value_dtype = "<f2" if k and len(frame.fields[2]) == 2 * k else "<f4"
        values = frame.array(2, value_dtype, k, "values").astype(np.float32)
        return indices, values

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        indices, values = self._decode_sparse_fields(frame)
        dense = np.zeros(frame.header.numel, dtype=np.float32)
        dense[indices] = values
        return dense
