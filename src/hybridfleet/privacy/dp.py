"""Differential privacy of a site's pushes: clip, add Gaussian noise, account.

Unit of privacy: one push's contribution — for a site that aggregates (``aggregate:
true``) the whole site's update of one round, otherwise one worker's; adjacency is
adding or removing that contribution (sensitivity ``clip_norm``). Every record a site
holds lies inside that contribution, so the same (epsilon, delta) bounds what the
model and the shards learn about any one record. Each round is a Gaussian mechanism
with noise ``noise_multiplier * clip_norm`` on an L2-clipped update; rounds compose
under Renyi DP (Google's ``dp-accounting``). Every site takes part in every round, so
no subsampling amplification is claimed.
"""

from __future__ import annotations

import math

import numpy as np

from hybridfleet.errors import SpecError



def epsilon_spent(noise_multiplier: float, steps: int, delta: float) -> float:
    """epsilon after ``steps`` Gaussian rounds with ``noise_multiplier``, at ``delta`` (RDP accountant)."""
    if steps <= 0:
        return 0.0
    from dp_accounting import dp_event, rdp

    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), steps))
    return float(accountant.get_epsilon(delta))


def steps_within_budget(noise_multiplier: float, delta: float, epsilon_budget: float, max_steps: int) -> int:
    """The most rounds (<= ``max_steps``) whose epsilon stays within ``epsilon_budget`` (binary search)."""
    if epsilon_spent(noise_multiplier, 1, delta) > epsilon_budget:
        raise SpecError(f"ps.privacy.epsilon_budget: {epsilon_budget} is spent by a single round at noise_multiplier "
                        f"{noise_multiplier} (epsilon {epsilon_spent(noise_multiplier, 1, delta):.3g}); "
                        "raise noise_multiplier or the budget")
    lo, hi = 1, max_steps
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if epsilon_spent(noise_multiplier, mid, delta) <= epsilon_budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class GaussianMechanism:
    """Clip a whole update (every tensor together) to L2 ``clip_norm``, add N(0, (sigma * clip_norm)^2)."""

    def __init__(self, clip_norm: float, noise_multiplier: float, seed: int | None = None):
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.rng = np.random.default_rng(seed)  # OS entropy unless a test fixes it
        self.rounds = 0
        self.clipped = 0

    def apply(self, update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The privatised update (new arrays; ``update`` is left as it is)."""
        norm = math.sqrt(sum(float(np.dot(v.reshape(-1), v.reshape(-1))) for v in update.values()))
        scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        self.clipped += scale < 1.0
        std = self.noise_multiplier * self.clip_norm
        out = {}
        for key, value in update.items():
            noise = self.rng.normal(0.0, std, size=value.shape).astype(np.float32)
            out[key] = (value * np.float32(scale)).astype(np.float32) + noise
        self.rounds += 1
        return out
