"""Advice for sparse codecs: does top-k / random-k keep enough coordinates a step to train?

Top-k and random-k keep ``max(1, ceil(ratio * numel))`` coordinates of each tensor a push
(one per bias at small ratios). Error feedback delays what they drop, it does not send it
sooner: when the whole model keeps fewer than `MIN_KEPT_PER_STEP` coordinates a step,
training falls behind (below either site alone), however many steps it runs. Evidence
(docs/wan-training.md, "Sparse codecs on small models"; ``bench/sparse_small_model.py``):
a 14k-parameter CNN at ratio 0.01 (about 140 a step) ended at 0.72-0.78 against 0.978
at 0.1; the 1.2M-parameter MLP of the compression figures keeps about 12,000 a step at
0.01 and trains as dense. What works for a small model: a larger ratio
(``MIN_KEPT_PER_STEP / parameters``, 0.1 for the 14k CNN) or DGC momentum on the workers
(``compression.momentum: 0.9`` with server-side plain SGD).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MIN_KEPT_PER_STEP = 1000
SPARSE = ("topk", "randomk")


def kept_per_step(ratio: float, sizes: Mapping[str, int]) -> int:
    """Coordinates a sparse codec keeps per push over tensors of these element counts."""
    return sum(min(n, max(1, math.ceil(ratio * n))) for n in sizes.values() if n > 0)


def sparse_advice(compression, sizes: Mapping[str, int]) -> str | None:
    """A warning when ``compression`` (a job's ``ps.compression``) keeps too few coordinates of a
    model with these tensor sizes (name -> elements) to train, naming the setting that works; else None."""
    if compression.codec not in SPARSE or not sizes:
        return None
    total = sum(sizes.values())
    kept = kept_per_step(compression.ratio, sizes)
    if kept >= MIN_KEPT_PER_STEP or kept >= total:
        return None
    ratio = min(1.0, round(math.ceil(MIN_KEPT_PER_STEP / total * 100) / 100, 2))
    fix = f"ps.compression.ratio: {ratio}"
    if not compression.momentum:
        fix += " or compression.momentum: 0.9 (DGC, with server-side plain SGD)"
    return (f"ps.compression: {compression.codec} at ratio {compression.ratio} keeps {kept} of this model's "
            f"{total} coordinates a step (fewer than {MIN_KEPT_PER_STEP}: a small model trains below either site "
            f"alone); use {fix}")


def spec_advice(compression) -> str | None:
    """What `hfleet spec check` can say before the model is known: the smallest model the ratio trains."""
    if compression.codec not in SPARSE:
        return None
    smallest = math.ceil(MIN_KEPT_PER_STEP / compression.ratio)
    return (f"ps.compression: {compression.codec} at ratio {compression.ratio} keeps {MIN_KEPT_PER_STEP} coordinates "
            f"a step only for models of at least {smallest:,} parameters; a smaller model needs a larger ratio "
            f"or compression.momentum: 0.9 (workers warn at connect once the model is known)")
