"""Differential privacy of a site's pushes: clip, add Gaussian noise, account.

Noise is the discrete Gaussian on the update rounded to a grid (`hybridfleet.privacy.discrete`),
safe under floating point. Unit of privacy: one push's contribution — for a site that aggregates (``aggregate:
true``) the whole site's update of one round, otherwise one worker's; adjacency is
adding or removing that contribution (sensitivity ``clip_norm``). Every record a site
holds lies inside that contribution, so the same (epsilon, delta) bounds what the
model and the shards learn about any one record. Each round is a Gaussian mechanism
with noise ``noise_multiplier * clip_norm`` on an L2-clipped update; rounds compose
under Renyi DP (Google's ``dp-accounting``). Every site takes part in every round, so
no subsampling amplification is claimed.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from hybridfleet.errors import SpecError
from hybridfleet.privacy.discrete import CryptoBits, sample_discrete_gaussian



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


def budgeted_steps(privacy, train_steps: int, local_steps: int | None = None) -> int:
    """The inner steps a job may train within ``privacy.epsilon_budget`` (a `PrivacySpec`): one
    noised push per step, or with ``local_steps`` H (``sync: local``) one per outer round of H
    steps, so the budget buys whole rounds and the result is a multiple of H."""
    per_push = local_steps or 1
    pushes = train_steps // per_push
    if privacy.epsilon_budget is None or pushes == 0:
        return train_steps
    allowed = steps_within_budget(privacy.noise_multiplier, privacy.delta, privacy.epsilon_budget, pushes)
    return train_steps if allowed >= pushes else allowed * per_push


class GaussianMechanism:
    """Clip a whole update (every tensor together) to L2 ``clip_norm`` and add discrete Gaussian
    noise of standard deviation ``noise_multiplier * clip_norm`` on a grid (`hybridfleet.privacy.discrete`).

    The grid step ``gamma`` is at most ``clip_norm / (50 sqrt(d))`` for d coordinates and
    makes ``sigma2 = (noise_multiplier * clip_norm / gamma)^2`` an integer >= 100. The update
    is clipped to ``clip_norm - gamma sqrt(d) / 2`` and rounded to the grid, so the rounded
    update's L2 norm is at most ``clip_norm``: the sensitivity in grid units is
    ``clip_norm / gamma`` and the noise multiplier the accountant sees is ``noise_multiplier``.
    Randomness: AES-256-CTR keyed from ``os.urandom`` (from ``seed`` when a test fixes it).
    """

    def __init__(self, clip_norm: float, noise_multiplier: float, seed: int | None = None):
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.seed = seed
        self.rounds = 0
        self.clipped = 0
        self.gamma: float | None = None
        self.sigma2: int | None = None

    def grid(self, numel: int) -> tuple[float, int]:
        """``(gamma, sigma2)`` for an update of ``numel`` coordinates."""
        std = self.noise_multiplier * self.clip_norm
        gamma = min(self.clip_norm / (50.0 * math.sqrt(max(numel, 1))), std / 10.0)
        sigma2 = max(100, round((std / gamma) ** 2))
        return std / math.sqrt(sigma2), sigma2

    def _bits(self) -> CryptoBits:
        if self.seed is None:
            return CryptoBits()
        return CryptoBits(hashlib.sha256(f"{self.seed}/{self.rounds}".encode()).digest())

    def apply(self, update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The privatised update (new float32 arrays; ``update`` is left as it is)."""
        names = list(update)
        flat = np.concatenate([np.asarray(update[k], dtype=np.float64).reshape(-1) for k in names]) if names \
            else np.zeros(0)
        gamma, sigma2 = self.grid(flat.size)
        self.gamma, self.sigma2 = gamma, sigma2
        bound = self.clip_norm - gamma * math.sqrt(flat.size) / 2
        norm = float(np.linalg.norm(flat))
        scale = min(1.0, bound / norm) if norm > 0 else 1.0
        self.clipped += scale < 1.0
        grid = np.rint(flat * (scale / gamma)).astype(np.int64)
        noised = grid + sample_discrete_gaussian(sigma2, flat.size, self._bits())
        values = (noised.astype(np.float64) * gamma).astype(np.float32)  # post-processing of exact integers
        out, offset = {}, 0
        for k in names:
            n = int(np.asarray(update[k]).size)
            out[k] = values[offset:offset + n].reshape(np.shape(update[k]))
            offset += n
        self.rounds += 1
        return out
