"""The rows codec: only the runs of non-zero coordinates travel, decoded exactly."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.codec.frame import pack_frame
from hybridfleet.errors import ProtocolError


def test_a_row_sparse_block_carries_one_run_per_touched_row_and_decodes_exactly():
    # Prepare: 10 rows of 4, rows 1, 2 (adjacent: one run) and 7 touched; a -0.0 is a value too
    table = np.zeros((10, 4), np.float32)
    table[[1, 2, 7]] = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    table[7, 3] = -0.0
    codec = get_codec("rows")
    # Execute
    payload = codec.encode(table)
    decoded = codec.decode(payload)
    sparse = codec.decode_sparse(payload)
    # Assert
    assert decoded.tobytes() == table.tobytes()
    assert sparse.indices.tolist() == [*range(4, 12), *range(28, 32)]
    assert len(payload) == 39 + 12 + 2 * 8 + 12 * 4  # header of a 2-d shape, params, two runs, the values


def test_gaps_of_two_zeros_or_fewer_travel_as_values():
    codec = get_codec("rows")
    flat = np.array([1, 0, 0, 2, 0, 0, 0, 3], np.float32)
    assert codec.decode_sparse(codec.encode(flat)).indices.tolist() == [0, 1, 2, 3, 7]


def _frame(numel: int, runs: list[tuple[int, int]], nvalues: int, values: int | None = None) -> bytes:
    return bytes(pack_frame("rows", np.dtype(np.float32), (numel,),
                            [struct.pack("<IQ", len(runs), nvalues), np.array(runs, "<u4").reshape(-1),
                             np.ones(nvalues if values is None else values, "<f4")]))


@pytest.mark.parametrize("payload, message", [
    (_frame(10, [(0, 2)], 11), "rows payload announces 11 values for a tensor of 10 elements"),
    (_frame(10, [(0, 2), (1, 2)], 4), "runs must be non-empty, increasing, disjoint and within 10 elements"),
    (_frame(10, [(8, 3)], 3), "runs must be non-empty, increasing, disjoint and within 10 elements"),
    (_frame(10, [(4, 0)], 0), "runs must be non-empty, increasing, disjoint and within 10 elements"),
    (_frame(10, [(0, 2)], 3), "the runs cover 2 values, the params announce 3"),
    (_frame(10, [(0, 2)], 2, values=3), "values field holds 12 bytes, expected 8"),
    (bytes(pack_frame("rows", np.dtype(np.float32), (10,), [struct.pack("<IQ", 2**31, 0), b"", b""])),
     "rows payload announces 2147483648 values for a tensor of 10 elements"),
], ids=["too-many-values", "overlap", "beyond-end", "empty-run", "count-mismatch", "values-length", "huge-count"])
def test_a_malformed_rows_frame_is_refused_before_anything_is_allocated(payload, message):
    with pytest.raises(ProtocolError, match=message):
        get_codec("rows").decode(payload, expected_numel=10)
