"""The lossless codec of row-sparse gradients: only the runs of non-zero coordinates travel.

An embedding built with ``sparse=True`` has a gradient that is zero outside the rows a batch
touched; its dense block would carry those zeros. A ``rows`` frame carries the runs of
coordinates that are not +0.0 (a touched row is one run of its width; runs closer than
`MERGE_GAP` zeros are sent as one) and their values in the input dtype::

    params   uint32 run count, uint64 value count
    runs     uint32 start, uint32 length of each run (starts increasing, runs disjoint)
    values   the runs' values back to back, little-endian, in the input dtype

Decoding is exact (the dense block, zeros elsewhere; -0.0 travels as a value). It is a wire
codec, not a job's ``ps.compression.codec``: a worker pushes the blocks of a row-sparse
gradient with it when the job's codec is ``none`` (see `hybridfleet.ps.worker.exchange`).
Every count is checked against the header before anything is allocated.
"""

from __future__ import annotations

import struct

import numpy as np

from hybridfleet.codec.base import Codec
from hybridfleet.codec.frame import Frame
from hybridfleet.errors import ProtocolError

_PARAMS = struct.Struct("<IQ")  # runs, values
# a gap of this many zeros or fewer costs no more than a run's 8-byte header: sent as values
MERGE_GAP = 2


def runs_of(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the runs of ``flat`` (1-D) that are not +0.0, gaps of `MERGE_GAP` or fewer joined."""
    bits = flat.view(np.dtype(f"u{flat.dtype.itemsize}"))
    edges = np.diff(np.concatenate(([0], (bits != 0).astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if starts.size > 1:
        keep = (starts[1:] - ends[:-1]) > MERGE_GAP
        starts = np.concatenate((starts[:1], starts[1:][keep]))
        ends = np.concatenate((ends[:-1][keep], ends[-1:]))
    return starts, ends


def _covered(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The int64 indices the runs cover, increasing."""
    if not starts.size:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


class RowsCodec(Codec):
    """Runs of non-zero coordinates and their values; exact in every input dtype."""

    name = "rows"
    num_fields = 3

    def _work_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype

    def _encode_fields(self, flat: np.ndarray) -> list:
        starts, ends = runs_of(flat)
        lengths = ends - starts
        runs = np.stack((starts, lengths), axis=1).astype("<u4").reshape(-1)
        values = flat[_covered(starts, lengths)].astype(flat.dtype.newbyteorder("<"), copy=False)
        return [_PARAMS.pack(starts.size, values.size), runs, values]

    def _decode_sparse_fields(self, frame: Frame) -> tuple[np.ndarray, np.ndarray]:
        count, nvalues = frame.params(0, _PARAMS, "params")
        numel = frame.header.numel
        if count > numel or nvalues > numel:
            raise ProtocolError(f"rows payload announces {max(count, nvalues)} values for a tensor of "
                                f"{numel} elements")
        runs = frame.array(1, "<u4", 2 * count, "runs").reshape(count, 2).astype(np.int64)
        starts, lengths = runs[:, 0], runs[:, 1]
        ends = starts + lengths
        if count and ((lengths == 0).any() or (starts[1:] < ends[:-1]).any() or ends[-1] > numel):
            raise ProtocolError(f"rows payload: runs must be non-empty, increasing, disjoint and within "
                                f"{numel} elements")
        if int(lengths.sum()) != nvalues:
            raise ProtocolError(f"rows payload: the runs cover {int(lengths.sum())} values, "
                                f"the params announce {nvalues}")
        dtype = frame.header.dtype.newbyteorder("<")
        values = frame.array(2, dtype, nvalues, "values").astype(frame.header.dtype, copy=False)
        return _covered(starts, lengths), values

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        indices, values = self._decode_sparse_fields(frame)
        dense = np.zeros(frame.header.numel, dtype=frame.header.dtype)
        dense[indices] = values
        return dense
