"""Top-k sparsification: send the k largest-magnitude elements."""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.sparse import SparseCodec


class TopKCodec(SparseCodec):
    """Keeps exactly the k = ceil(ratio * numel) elements of largest |x| (ties broken arbitrarily).

    Kept values are exact float32; the others decode to zero. Options:
    `ratio` in (0, 1]; `index_coding` "int32", "delta" (varint gaps) or
    "auto" (the shorter of the two, chosen per payload).
    """

    name = "topk"

    def _select(self, flat: np.ndarray, k: int) -> np.ndarray:
        if k == flat.size:
            return np.arange(k, dtype=np.int64)
        kept = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k :]
        kept.sort()
        return kept.astype(np.int64, copy=False)
