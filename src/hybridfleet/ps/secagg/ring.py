"""Fixed-point quantisation of updates into the ring Z_{2^bits}.

A coordinate is clipped to ``[-clip, clip]`` and stochastically rounded to an integer
in ``[-L, L]`` with ``L = floor((2^(bits-1) - 1) / pushers)``, i.e. scale ``S = L / clip``.
The sum of ``pushers`` such integers lies in ``[-pushers * L, pushers * L]``, inside the
signed range of ``bits`` bits, so the modular sum never wraps: reading it back as a
signed integer gives the exact integer sum. Each pusher's rounding error is below
``1 / S = clip / L`` per coordinate (zero in expectation); the sum's below
``pushers * clip / L``.
"""

from __future__ import annotations

import numpy as np

RING_DTYPES = {16: (np.dtype("<u2"), np.dtype("<i2")), 32: (np.dtype("<u4"), np.dtype("<i4"))}
MIN_LEVELS = 1 << 7  # fewer distinct values per pusher than this is refused as meaningless


def levels(bits: int, pushers: int) -> int:
    """``L``: the largest integer one pusher may send so that ``pushers`` of them cannot overflow."""
    if bits not in RING_DTYPES:
        raise ValueError(f"bits must be one of {sorted(RING_DTYPES)} (got {bits})")
    if pushers < 1:
        raise ValueError(f"pushers must be >= 1 (got {pushers})")
    return ((1 << (bits - 1)) - 1) // pushers


def check_resolution(bits: int, pushers: int) -> int:
    """``L`` after refusing a ring too narrow for ``pushers`` (fewer than `MIN_LEVELS` values each)."""
    limit = levels(bits, pushers)
    if 2 * limit + 1 < MIN_LEVELS:
        raise ValueError(f"a {bits}-bit ring shared by {pushers} pushers leaves each only {2 * limit + 1} "
                         f"quantisation levels (at least {MIN_LEVELS} are needed); use bits: 32")
    return limit


def quantise(x: np.ndarray, clip: float, limit: int, bits: int, rng: np.random.Generator) -> np.ndarray:
    """``x`` (float) as ring elements: clipped, scaled by ``limit / clip``, stochastically rounded
    (``floor(v + U)``, U uniform in [0, 1): up with the odds of v's fraction, so unbiased)."""
    scaled = np.multiply(np.asarray(x).reshape(-1), limit / clip, dtype=np.float64)
    np.clip(scaled, -limit, limit, out=scaled)
    scaled += rng.random(scaled.size)
    np.floor(scaled, out=scaled)
    unsigned, signed = RING_DTYPES[bits]
    return scaled.astype(signed).view(unsigned)  # two's complement: negatives wrap into the ring


def dequantise(ring: np.ndarray, clip: float, limit: int, bits: int) -> np.ndarray:
    """A (non-wrapped) ring sum back to float32: read as signed, divided by the scale."""
    signed = ring.astype(RING_DTYPES[bits][0], copy=False).view(RING_DTYPES[bits][1])
    return (signed.astype(np.float64) * (clip / limit)).astype(np.float32)
