"""The discrete Gaussian mechanism: integer noise on an update quantised to a grid.

Floating-point Gaussian noise is not differentially private as implemented: the set of
doubles a sampler can return around ``x + noise`` depends on ``x`` (Mironov, CCS 2012,
for Laplace; the same holds for Gaussian samplers). Here the clipped update is rounded
to a grid of step ``gamma``, integer noise from the discrete Gaussian N_Z(0, sigma^2)
is added to each grid coordinate, and only the integer sum is turned back into floats
(post-processing). Noise and sum are exact integers, so no floating-point artefact
depends on the input.

The sampler is the rejection sampler of Canonne, Kamath and Steinke ("The Discrete
Gaussian for Differential Privacy", NeurIPS 2020, Algorithm 3): a two-sided geometric
(discrete Laplace) proposal of scale ``t = floor(sigma) + 1``, accepted with probability
``exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2))``. It is exact and vectorised: every random
decision compares a uniform real number with a real threshold, and the uniform is drawn
64 bits at a time; the comparison is made in float64 with a safety margin and, in the
rare case (about one in 10^9 decisions) the margin cannot decide, redone exactly with
`decimal` at high precision after drawing further bits of the same uniform. The bits
come from AES-256 in counter mode keyed with 32 bytes of `os.urandom` per call (a
cryptographically secure generator; numpy's PCG/Philox are not).
"""

from __future__ import annotations

import decimal
import math
import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_TWO64 = float(2**64)
_MARGIN = 1e-9  # relative, on an acceptance probability: float64 errs by ~1e-13 at most


class CryptoBits:
    """Uniform 64-bit words from AES-256-CTR keyed with fresh OS entropy."""

    def __init__(self, key: bytes | None = None):
        self._enc = Cipher(algorithms.AES(key or os.urandom(32)), modes.CTR(bytes(16))).encryptor()

    def words(self, n: int) -> np.ndarray:
        return np.frombuffer(self._enc.update(bytes(8 * n)), dtype="<u8").copy()


def _exact_less(m: int, bits: CryptoBits, threshold) -> bool:
    """Whether the uniform real whose first 64 bits are ``m`` is below ``threshold(ctx)`` (a Decimal
    in (0, 1]), drawing further bits until decided."""
    ctx = decimal.Context(prec=60)
    num, scale = int(m), 64
    t = threshold(ctx)
    while True:
        lo = ctx.divide(decimal.Decimal(num), decimal.Decimal(2) ** scale)
        hi = ctx.divide(decimal.Decimal(num + 1), decimal.Decimal(2) ** scale)
        if hi <= t:
            return True
        if lo >= t:
            return False
        num = (num << 64) | int(bits.words(1)[0])
        scale += 64
        ctx = decimal.Context(prec=ctx.prec + 25)
        t = threshold(ctx)


def _below(u: np.ndarray, p: np.ndarray, bits: CryptoBits, exact_p) -> np.ndarray:
    """Bernoulli decisions ``U < p`` for uniforms whose first 64 bits are ``u``; ``exact_p(i, ctx)``
    gives p[i] as a Decimal for the undecided ones."""
    lo, hi = u.astype(np.float64) / _TWO64, (u.astype(np.float64) + 1.0) / _TWO64
    out = hi < p * (1 - _MARGIN)
    unsure = ~out & (lo <= p * (1 + _MARGIN))
    for i in np.flatnonzero(unsure):
        out[i] = _exact_less(int(u[i]), bits, lambda ctx, i=i: exact_p(i, ctx))
    return out


def _geometric(n: int, t: int, bits: CryptoBits) -> np.ndarray:
    """``n`` draws of G with P(G >= g) = exp(-g / t): G = floor(-t ln U), decided exactly."""
    u = bits.words(n)
    # U lies in [u, u+1) / 2^64; -t ln U lies in (g_lo, g_hi]
    g_hi = -t * np.log(np.maximum(u, 1).astype(np.float64) / _TWO64)
    g_lo = -t * np.log((u.astype(np.float64) + 1.0) / _TWO64)
    # float64 errs by a few ulps of |g| + t (u rounded to 53 bits, log, product); the margin is far wider
    slack = 1e-12 * (g_hi + t)
    f_lo = np.floor(g_lo - slack)
    f_hi = np.floor(g_hi + slack)
    out = f_lo.astype(np.int64)
    for i in np.flatnonzero((f_lo != f_hi) | (u == 0)):
        # G >= g iff U <= exp(-g/t): find the largest g with U below exp(-g/t), starting at the float guess
        g = max(int(f_lo[i]), 0)
        m = int(u[i])
        while _exact_less(m, bits, lambda ctx, g=g: ctx.exp(decimal.Decimal(-(g + 1)) / t)):
            g += 1
        out[i] = g
    return out


def sample_discrete_gaussian(sigma2: int, n: int, bits: CryptoBits | None = None) -> np.ndarray:
    """``n`` independent draws of the discrete Gaussian N_Z(0, ``sigma2``) (int64), P(y) ∝ exp(-y^2 / (2 sigma2)).

    ``sigma2`` is an integer (the mechanism picks its grid so that it is); exact up to the
    generator (`CryptoBits`)."""
    if not isinstance(sigma2, int) or sigma2 < 1:
        raise ValueError(f"sigma2: must be an integer >= 1 (got {sigma2!r})")
    bits = bits or CryptoBits()
    t = math.isqrt(sigma2) + 1  # floor(sigma) + 1
    out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        want = max(64, int((n - filled) * 1.6))
        g = _geometric(want, t, bits)
        negative = (bits.words(want) >> np.uint64(63)).astype(bool)
        keep = ~(negative & (g == 0))  # two-sided geometric: -0 is rejected so 0 is not counted twice
        y = np.where(negative, -g, g)[keep]
        a = np.abs(y)
        # acceptance exp(-(|y| - sigma2/t)^2 / (2 sigma2)) = exp(-(|y| t - sigma2)^2 / (2 sigma2 t^2))
        p = np.exp(-((a - sigma2 / t) ** 2) / (2.0 * sigma2))  # float64: off by ~1e-13 relative at most
        den = decimal.Decimal(2 * sigma2 * t * t)
        accept = _below(bits.words(y.size), p, bits,
                        lambda i, ctx: ctx.exp(-ctx.divide(decimal.Decimal((int(a[i]) * t - sigma2) ** 2), den)))
        got = y[accept][: n - filled]
        out[filled:filled + got.size] = got
        filled += got.size
    return out
