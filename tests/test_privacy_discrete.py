"""The discrete Gaussian sampler against its pmf, the mechanism's grid, and the DP budget in outer rounds."""

from __future__ import annotations

import decimal
import math

import numpy as np
import pytest
from scipy import stats

from hybridfleet.privacy import GaussianMechanism, budgeted_steps, epsilon_spent, steps_within_budget
from hybridfleet.privacy.discrete import CryptoBits, _exact_less, sample_discrete_gaussian
from hybridfleet.spec.models import JobSpec, PrivacySpec


def _pmf(sigma2: int, support: np.ndarray) -> np.ndarray:
    k = np.arange(-60 * math.isqrt(sigma2) - 60, 60 * math.isqrt(sigma2) + 61)
    norm = np.exp(-(k.astype(float) ** 2) / (2 * sigma2)).sum()
    return np.exp(-(support.astype(float) ** 2) / (2 * sigma2)) / norm


@pytest.mark.parametrize("sigma2", [2, 9, 400])
def test_the_sampler_follows_the_discrete_gaussian_pmf(sigma2):
    draws = sample_discrete_gaussian(sigma2, 200_000, CryptoBits(bytes([sigma2 % 256]) * 32))
    sigma = math.sqrt(sigma2)
    edge = int(4 * sigma) + 1
    support = np.arange(-edge, edge + 1)
    expected = _pmf(sigma2, support) * draws.size
    observed = np.array([np.count_nonzero(draws == k) for k in support], dtype=float)
    # the tails beyond +-edge in one bin each side
    tail = (draws.size - expected.sum()) / 2
    observed = np.concatenate([[np.count_nonzero(draws < -edge)], observed, [np.count_nonzero(draws > edge)]])
    expected = np.concatenate([[tail], expected, [tail]])
    keep = expected >= 5
    chi2 = stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum())
    assert chi2.pvalue > 1e-4, chi2
    assert draws.dtype == np.int64 and abs(draws.var() / sigma2 - 1) < 0.02


def test_a_large_sigma_keeps_its_variance_and_symmetry():
    draws = sample_discrete_gaussian(10**8, 200_000, CryptoBits(b"\x07" * 32))
    assert abs(draws.var() / 1e8 - 1) < 0.02
    ks = stats.kstest(draws / 1e4, "norm")  # sigma = 1e4 grid steps: the discrete law is the normal's to 1e-4
    assert ks.pvalue > 1e-4


def test_an_undecided_comparison_is_settled_exactly_with_more_bits():
    # U's first 64 bits put it in [1/2, 1/2 + 2^-64); a threshold inside that interval needs more bits
    bits = CryptoBits(b"\x01" * 32)
    half = 1 << 63
    inside = lambda ctx: ctx.divide(decimal.Decimal(1), decimal.Decimal(2)) + decimal.Decimal(2) ** -70  # noqa: E731
    results = {_exact_less(half, bits, inside) for _ in range(64)}
    assert results == {True, False}  # decided by the further bits, both ways across draws
    assert _exact_less(half, bits, lambda ctx: decimal.Decimal("0.75")) is True
    assert _exact_less(half, bits, lambda ctx: decimal.Decimal("0.25")) is False


def test_bad_sigma2_is_refused():
    with pytest.raises(ValueError, match="sigma2: must be an integer >= 1"):
        sample_discrete_gaussian(0.5, 10)


def test_the_mechanism_adds_integer_noise_on_a_grid_and_bounds_the_rounded_norm():
    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=0.8, seed=3)
    update = {"w": np.full(10_000, 5.0, np.float32)}
    out = mech.apply(update)["w"]
    gamma, sigma2 = mech.gamma, mech.sigma2
    assert gamma * math.sqrt(sigma2) == pytest.approx(0.8, rel=1e-12)  # noise std = noise_multiplier * clip_norm
    assert gamma <= 1.0 / (50 * math.sqrt(10_000)) and sigma2 >= 100
    steps = out.astype(np.float64) / gamma
    assert np.abs(steps - np.rint(steps)).max() < 1e-3 * np.abs(steps).max()  # on the grid, up to float32
    assert out.std() == pytest.approx(0.8, rel=0.03)


def test_the_local_mode_budget_counts_outer_rounds_at_the_boundary():
    # sigma 3, epsilon 8, 2000 inner steps, H 50: 40 outer rounds, each one noised push
    p = PrivacySpec(clip_norm=1.0, noise_multiplier=3.0, delta=1e-5, epsilon_budget=8.0)
    rounds = steps_within_budget(3.0, 1e-5, 8.0, 40)
    assert budgeted_steps(p, 2000, 50) == (2000 if rounds >= 40 else rounds * 50)
    assert budgeted_steps(p, 2000, 50) > 22  # counted in inner steps, the old rule cut the job to 22 steps
    # exactly at the budget of 10 rounds: 10 rounds = 500 inner steps; a hair below: 9 rounds
    at = epsilon_spent(3.0, 10, 1e-5)
    assert budgeted_steps(PrivacySpec(clip_norm=1.0, noise_multiplier=3.0, epsilon_budget=at), 2000, 50) == 500
    below = PrivacySpec(clip_norm=1.0, noise_multiplier=3.0, epsilon_budget=at * (1 - 1e-9))
    assert budgeted_steps(below, 2000, 50) == 450
    assert budgeted_steps(below, 2000, None) == 9  # bsp: one push per step


def test_a_local_mode_session_trains_the_rounds_its_budget_allows():
    from hybridfleet.ps.worker.session import PSSession, WorkerConfig

    at = epsilon_spent(3.0, 10, 1e-5)
    job = JobSpec.model_validate({
        "name": "dp-local", "framework": "torch", "entrypoint": "train.py", "mode": "ps",
        "sites": {"a": {"workers": 1}, "b": {"workers": 1}}, "train": {"steps": 2000},
        "ps": {"sync": "local", "local_steps": 50,
               "privacy": {"clip_norm": 1.0, "noise_multiplier": 3.0, "epsilon_budget": at}}})
    PSSession({"w": (3,)}, WorkerConfig(job=job, site="a", servers=["127.0.0.1:1"]), "torch")
    assert job.train.steps == 500  # 10 outer rounds of 50 inner steps
