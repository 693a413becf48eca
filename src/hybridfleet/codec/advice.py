"""Advice for sparse codecs: does top-k / random-k keep enough coordinates a step to train?

Top-k and random-k keep ``max(1, ceil(ratio * numel))`` coordinates of each tensor a push
(one per bias at small ratios). Error feedback delays what they drop, it does not send it
sooner. The rule: a model that keeps fewer than `MIN_KEPT_PER_STEP` coordinates a step
is warned about; it is at risk most with server-side momentum, whose update of every
coordinate the sparse downlink cannot follow. Evidence (``bench/sparse_small_model.py``,
docs/wan-training.md "Sparse codecs on small models"): on a 1,386-parameter BatchNorm
CNN, two sites, 300 steps, top-k 1% (18 coordinates a step) reached 0.961 against 0.972
dense with server-side plain SGD, but 0.900 against 0.967 dense with server-side SGD
momentum 0.9; a 14k-parameter CNN at 1% (about 140 a step) with server momentum was
reported at 0.72-0.78, below either site alone, and at 0.978 with ratio 0.1 (1,400 a
step); the 1.2M-parameter MLP of the compression figures keeps about 12,000 a step at 1%
and trains as dense. What works: a larger ratio (``MIN_KEPT_PER_STEP / parameters``), or
DGC momentum on the workers (``compression.momentum: 0.9``) with server-side plain SGD
at about a tenth of the learning rate (momentum multiplies the step by ~10: DGC at lr 0.3
diverged, at lr 0.03 it reached 0.947).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MIN_KEPT_PER_STEP = 1000
SPARSE = ("topk", "randomk")


def kept_per_step(ratio: float, sizes: Mapping[str, int]) -> int:
    """Coordinates a sparse codec keeps per push over tensors of these element counts."""
    return sum(min(n, max(1, math.ceil(ratio * n))) for n in sizes.values() if n > 0)


def sparse_advice(compression, sizes: Mapping[str, int], optimizer=None) -> str | None:
    """A warning when ``compression`` (a job's ``ps.compression``) keeps too few coordinates of a
    model with these tensor sizes (name -> elements) to train, naming the setting that works; else None.
    ``optimizer``: the job's server-side ``ps.optimizer`` (momentum makes it worse)."""
    if compression.codec not in SPARSE or not sizes:
        return None
    total = sum(sizes.values())
    kept = kept_per_step(compression.ratio, sizes)
    if kept >= MIN_KEPT_PER_STEP or kept >= total:
        return None
    ratio = min(1.0, math.ceil(MIN_KEPT_PER_STEP / total * 100) / 100)
    fix = f"ps.compression.ratio: {ratio:g}"
    if not compression.momentum:
        fix += " or compression.momentum: 0.9 (DGC) with server-side plain SGD at a tenth of the learning rate"
    server_momentum = optimizer is not None and (optimizer.name != "sgd" or optimizer.momentum > 0)
    risk = ("with server-side momentum such a model trains below either site alone" if server_momentum
            else "such a model trains slower and may end lower than dense")
    return (f"ps.compression: {compression.codec} at ratio {compression.ratio:g} keeps {kept} of this model's "
            f"{total} coordinates a step (fewer than {MIN_KEPT_PER_STEP}); {risk}; use {fix}")


def spec_advice(compression) -> str | None:
    """What `hfleet spec check` can say before the model is known: the smallest model the ratio trains."""
    if compression.codec not in SPARSE:
        return None
    smallest = math.ceil(MIN_KEPT_PER_STEP / compression.ratio)
    return (f"ps.compression: {compression.codec} at ratio {compression.ratio} keeps {MIN_KEPT_PER_STEP} coordinates "
            f"a step only for models of at least {smallest:,} parameters; a smaller model needs a larger ratio "
            f"or compression.momentum: 0.9 (workers warn at connect once the model is known)")
