"""Discrete Gaussian noise (exact sampler, AES-CTR bits) vs numpy's floating-point Gaussian.

    python bench/dp_noise.py            # 1M coordinates, sigma2 in {100, 10^6, 2x10^10}, median of 3
    python bench/dp_noise.py --quick    # 1M coordinates, sigma2 = 10^6 only, median of 1

Both sides privatise the same 1M-coordinate float32 update with noise multiplier 1 and
clip norm 1: ``discrete`` is `hybridfleet.privacy.GaussianMechanism.apply` (clip, round to
the grid, integer noise from `sample_discrete_gaussian`, back to float32); ``numpy`` is
clip + ``numpy.random.default_rng().normal`` (the floating-point mechanism it replaces,
which is not DP as implemented). The sampler alone is also timed at fixed sigma2.
``ratio`` = discrete / numpy wall time of one push's privatisation.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np

from hybridfleet.privacy import GaussianMechanism
from hybridfleet.privacy.discrete import sample_discrete_gaussian

NUMEL = 1_000_000


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _float_mechanism(update: np.ndarray, rng) -> np.ndarray:
    norm = float(np.linalg.norm(update))
    return (update * min(1.0, 1.0 / norm)).astype(np.float32) + rng.normal(0, 1.0, update.shape).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    update = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    mech, rng = GaussianMechanism(1.0, 1.0), np.random.default_rng()
    discrete_s = _median_s(lambda: mech.apply({"w": update}), repeats)
    numpy_s = _median_s(lambda: _float_mechanism(update, rng), repeats)
    by_sigma2 = {}
    for sigma2 in ([10**6] if args.quick else [100, 10**6, 2 * 10**10]):
        by_sigma2[str(sigma2)] = round(_median_s(lambda s=sigma2: sample_discrete_gaussian(s, NUMEL), repeats), 3)
    print(f"{'side':>10}  {'s per 1M-coordinate push':>26}")
    print(f"{'discrete':>10}  {discrete_s:26.3f}   (grid sigma2 {mech.sigma2}, gamma {mech.gamma:.3g})")
    print(f"{'numpy':>10}  {numpy_s:26.3f}")
    for s2, sec in by_sigma2.items():
        print(f"  sampler alone, sigma2 {s2:>12}: {sec:.3f} s")
    print(json.dumps({"bench": "dp_noise", "ratio": round(discrete_s / numpy_s, 2), "sides": "discrete/numpy",
                      "numel": NUMEL, "discrete_s": round(discrete_s, 3), "numpy_s": round(numpy_s, 3),
                      "sampler_s_by_sigma2": by_sigma2, "grid_sigma2": mech.sigma2,
                      "grid_gamma": float(f"{mech.gamma:.6g}"), "noise_std": math.sqrt(mech.sigma2) * mech.gamma}))


if __name__ == "__main__":
    main()
