"""The checkpoint reader accepts exactly the safetensors files the safetensors library accepts.

Each malformed file below is one the library refuses (its own refusal cases: a header
that is not an object, non-UTF-8 or non-JSON header, overlapping, gapped or overrunning data offsets,
offsets that disagree with the shape, trailing bytes, non-string metadata). The test
checks both readers on the same bytes, so a drift of either side fails it.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors
from safetensors.numpy import save

from hybridfleet.ckpt import safetensors_io
from hybridfleet.errors import CheckpointError


def raw_file(header: dict | bytes, data: bytes) -> bytes:
    """A safetensors file from a header (dict: JSON-encoded) and the data section, byte for byte."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


F32x2 = {"dtype": "F32", "shape": [2]}
MALFORMED = {
    "overlapping offsets (two tensors alias the same bytes)": raw_file(
        {"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [0, 8]}}, bytes(8)),
    "partly overlapping offsets": raw_file(
        {"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)),
    "a gap between tensors": raw_file(
        {"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [12, 20]}}, bytes(20)),
    "data not starting at offset 0": raw_file({"a": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)),
    "bytes after the last tensor": raw_file({"a": {**F32x2, "data_offsets": [0, 8]}}, bytes(12)),
    "offsets past the end of the file": raw_file({"a": {**F32x2, "data_offsets": [0, 8]}}, bytes(4)),
    "offsets that disagree with dtype and shape": raw_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
    "header that is a JSON list, not an object": raw_file(b'[{"dtype":"F32","shape":[2],"data_offsets":[0,8]}]', bytes(8)),
    "header that is not UTF-8": raw_file(b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
    "header that is not JSON": raw_file(b"{not json}", bytes(8)),
    "metadata with a non-string value": raw_file(
        {"__metadata__": {"role": 3}, "a": {**F32x2, "data_offsets": [0, 8]}}, bytes(8)),
    "header length beyond the file": struct.pack("<Q", 1 << 20) + b"{}",
    "file shorter than its length field": b"\x01\x00\x00",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_refused_by_the_library_and_by_the_reader(case):
    data = MALFORMED[case]
    with pytest.raises(Exception):  # the reference reader refuses it ...
        safetensors.deserialize(data)
    with pytest.raises(CheckpointError, match="safetensors"):  # ... and so does ours, naming the file kind
        safetensors_io.decode(bytearray(data), "ckpt/x.safetensors")


def test_files_of_the_library_and_of_the_writer_are_read_alike():
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.arange(5, dtype=np.int64),
              "empty": np.zeros((0, 3), dtype=np.float16)}
    ours = b"".join(bytes(p) for p in safetensors_io.encode(arrays, metadata={"role": "tensors"}))
    for data in (save(arrays, metadata={"role": "tensors"}), ours):
        tensors, metadata = safetensors_io.decode(bytearray(data))
        assert metadata == {"role": "tensors"}
        assert sorted(tensors) == sorted(arrays)
        for name, arr in arrays.items():
            np.testing.assert_array_equal(tensors[name], arr)
        assert sorted(name for name, _ in safetensors.deserialize(data)) == sorted(arrays)  # the library reads it too
