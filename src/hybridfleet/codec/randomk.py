"""Random-k sparsification: send k elements chosen uniformly at random."""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.sparse import SparseCodec


class RandomKCodec(SparseCodec):
    """Keeps k = ceil(ratio * numel) elements drawn uniformly without replacement.

    The draw comes from `numpy.random.default_rng(seed)`, advanced on every
    encode, so a seeded codec repeats its sequence of subsets. The indices
    travel on the wire (delta-coded when shorter), so decoding needs no shared
    random state and does not depend on numpy's generator streams.

    Unscaled by default (`scale=False`): kept values are exact, as analysed for
    random-k with memory (Stich et al., 2018) and what error feedback wants.
    `scale=True` multiplies kept values by numel / k, giving an unbiased but
    high-variance estimate for use without error feedback.
    """

    name = "randomk"

    def __init__(self, ratio: float = 0.01, index_coding: str = "auto", seed: int | None = None, scale: bool = False,
                 value_dtype: str = "float32"):
        super().__init__(ratio=ratio, index_coding=index_coding, value_dtype=value_dtype)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"randomk: seed must be a non-negative integer or None (got {seed!r})")
        if not isinstance(scale, bool):
            raise ValueError(f"randomk: scale must be true or false (got {scale!r})")
        self.seed = seed
        self.scale = scale
        self._rng = np.random.default_rng(seed)

    def options(self) -> dict:
        return {**super().options(), "seed": self.seed, "scale": self.scale}

    def _select(self, flat: np.ndarray, k: int) -> np.ndarray:
        if k == flat.size:
            return np.arange(k, dtype=np.int64)
        chosen = self._rng.choice(flat.size, size=k, replace=False)
        chosen.sort()
        return chosen.astype(np.int64, copy=False)

    def _values(self, flat: np.ndarray, indices: np.ndarray) -> np.ndarray:
        values = flat[indices]
        if self.scale and indices.size:
            values = values * np.float32(flat.size / indices.size)
        return values
