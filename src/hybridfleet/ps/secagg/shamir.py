"""t-of-n Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

A secret is the constant term of a random polynomial of degree ``t - 1``; share ``x``
is the polynomial's value at ``x`` (x = 1..n). Any ``t`` shares interpolate the secret;
any ``t - 1`` are consistent with every secret (each value of the constant term gives
exactly one polynomial through them), so they reveal nothing about it.
"""

from __future__ import annotations

import secrets

PRIME = (1 << 521) - 1          # Mersenne prime: every 256-bit secret is a field element
SHARE_BYTES = 66                # 521 bits, big-endian
SECRET_BYTES = 32


def split(secret: bytes, xs: list[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` at the points ``xs`` (distinct, 1..PRIME-1), any ``threshold`` of which recover it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes (got {len(secret)})")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold must be in 1..{len(xs)} (got {threshold})")
    if len(set(xs)) != len(xs) or not all(0 < x < PRIME for x in xs):
        raise ValueError("share points must be distinct and non-zero")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[x] = y.to_bytes(SHARE_BYTES, "big")
    return out


def interpolate(shares: dict[int, bytes], at: int = 0) -> int:
    """The polynomial through ``shares`` ({x: y}) evaluated at ``at`` (Lagrange)."""
    points = [(x, int.from_bytes(y, "big")) for x, y in shares.items()]
    if any(y >= PRIME for _, y in points):
        raise ValueError("a share is not a field element")
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def reconstruct(shares: dict[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares ({x: y}); ValueError with fewer."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} share(s) cannot recover a secret split {threshold}-of-n")
    chosen = dict(list(shares.items())[:threshold])
    value = interpolate(chosen)
    if value >> (8 * SECRET_BYTES):
        raise ValueError("the shares do not interpolate to a 32-byte secret (a share is wrong)")
    return value.to_bytes(SECRET_BYTES, "big")
