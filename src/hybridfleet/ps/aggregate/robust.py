"""Robust rules: a site that pushes a scaled, sign-flipped or crafted update moves the
model by no more than the rule's bound.

Every rule first turns a contribution into the mean update of the workers it stands
for (``update / weight``), so a site leader's sum and a lone worker's gradient
compare like for like. The shard sees only its own keys, so each bound holds per
shard (for ``norm_clip`` the whole model's bound is ``clip_norm * sqrt(shards)``).

- ``median``: coordinate-wise median. With n contributions of which f are crafted,
  f < n/2, every coordinate of the result lies within the honest values' range.
- ``trimmed_mean``: per coordinate, drop the ``ceil(trim_fraction * n)`` largest and
  smallest values and average the rest; the same guarantee for f <= that count.
- ``norm_clip``: scale each contribution down to L2 norm ``clip_norm`` (on this
  shard), then the weighted mean: one site moves the result by at most
  ``clip_norm * weight / total_weight``, whatever it sends.
"""

from __future__ import annotations

import math

import numpy as np

from hybridfleet.ps.aggregate.base import RoundAggregator


class _Stacked(RoundAggregator):
    """Keeps each contribution (as a per-worker mean) until the round closes."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[tuple[dict[str, np.ndarray], int]] = []

    def _add(self, update: dict[str, np.ndarray], weight: int) -> None:
        self.updates.append(({k: v / weight if weight > 1 else v for k, v in update.items()}, weight))

    def _keys(self) -> list[str]:
        """Every key some contribution carries (a key without a gradient is left out of a push)."""
        return sorted({k for u, _ in self.updates for k in u})

    def _stack(self, key: str) -> np.ndarray:
        """The contributions to ``key``; one that lacks it had no gradient there and counts as zeros."""
        size = next(u[key].size for u, _ in self.updates if key in u)
        return np.stack([u[key] if key in u else np.zeros(size, np.float32) for u, _ in self.updates])


class MedianRound(_Stacked):
    """Coordinate-wise median of the contributions."""

    def result(self) -> dict[str, np.ndarray]:
        return {k: np.median(self._stack(k), axis=0).astype(np.float32) for k in self._keys()}


class TrimmedMeanRound(_Stacked):
    """Coordinate-wise mean after dropping the ``ceil(trim_fraction * n)`` extremes on each side."""

    def __init__(self, trim_fraction: float) -> None:
        super().__init__()
        self.trim_fraction = trim_fraction

    def trimmed(self, n: int) -> int:
        """How many values each side loses with ``n`` contributions (always leaves at least one)."""
        return min(math.ceil(self.trim_fraction * n), (n - 1) // 2)

    def result(self) -> dict[str, np.ndarray]:
        n = len(self.updates)
        cut = self.trimmed(n)
        out = {}
        for k in self._keys():
            values = np.sort(self._stack(k), axis=0)
            out[k] = values[cut:n - cut].mean(axis=0).astype(np.float32)
        return out


class NormClipRound(_Stacked):
    """Weighted mean of the contributions, each scaled down to L2 norm ``clip_norm`` first."""

    def __init__(self, clip_norm: float) -> None:
        super().__init__()
        self.clip_norm = clip_norm
        self.clipped = 0  # how many contributions this round were scaled down

    def result(self) -> dict[str, np.ndarray]:
        total = sum(w for _, w in self.updates)
        out: dict[str, np.ndarray] = {}
        for update, weight in self.updates:
            norm = math.sqrt(sum(float(np.dot(v, v)) for v in update.values()))
            scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
            self.clipped += scale < 1.0
            for k, v in update.items():
                term = v * np.float32(scale * weight / total)
                out[k] = out[k] + term if k in out else term
        return out
