"""Digits data split across sites, the way a hospital and a cloud hold different patients.

scikit-learn ships the 8x8 digits set (1,797 images), so nothing is downloaded.
A fixed 20% is held out as the common test set. The rest is split non-IID:
site A holds 90% of the 0-4 images and 10% of the 5-9 ones, site B the remainder.
A site's loader returns only that site's rows: its data never leaves it.
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SEED = 0
MAJORITY_FRACTION = 0.9


def _train_test():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int64), test_size=0.2, random_state=SEED, stratify=y)


def load_test() -> tuple[np.ndarray, np.ndarray]:
    """The held-out test set shared by every site."""
    _, x_test, _, y_test = _train_test()
    return x_test, y_test


def load_site(name: str, shard: int = 0, num_shards: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of site ``name`` (``digits:site-a`` or ``digits:site-b``), then this worker's 1/num_shards of them."""
    x, _, y, _ = _train_test()
    rng = np.random.default_rng(SEED)
    to_a = np.where(y < 5, rng.random(len(y)) < MAJORITY_FRACTION, rng.random(len(y)) >= MAJORITY_FRACTION)
    part = {"digits:site-a": to_a, "digits:site-b": ~to_a}.get(name)
    if part is None:
        raise ValueError(f"unknown site data {name!r}: use digits:site-a or digits:site-b")
    idx = np.flatnonzero(part)[shard::num_shards]
    return x[idx], y[idx]
