"""Digits data split across sites, the way a hospital and a cloud hold different patients.

scikit-learn ships the 8x8 digits set (1,797 images), so nothing is downloaded.
A fixed 20% is held out as the common test set. The rest is split non-IID:
site A holds 90% of the 0-4 images and 10% of the 5-9 ones, site B the remainder.
A site's loader returns only that site's rows: its data never leaves it.

A site's data is either a packed dataset (``examples/digits/data/site-a``, made by
``python examples/digits/pack_sites.py`` with ``hfleet data pack``; what the shipped
jobs use) or the named split ``digits:site-a`` / ``digits:site-b`` computed here.
The 80/20 split of scikit-learn's digits is saved once (``data/split.npz``, written by
pack_sites.py), so a worker reads rows and never imports scikit-learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SEED = 0
MAJORITY_FRACTION = 0.9
SPLIT = Path(__file__).resolve().parent / "data" / "split.npz"


def sklearn_split() -> dict[str, np.ndarray]:
    """scikit-learn's digits split 80/20, stratified: pixels as uint8 0-16 (what pack_sites.py saves as ``SPLIT``)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x.astype(np.uint8), y.astype(np.int64), test_size=0.2,
                                                        random_state=SEED, stratify=y)
    return {"x_train": x_train, "x_test": x_test, "y_train": y_train, "y_test": y_test}


def _train_test():
    with np.load(SPLIT) as saved:
        return (saved["x_train"] / np.float32(16.0), saved["x_test"] / np.float32(16.0),
                saved["y_train"], saved["y_test"])


def load_test() -> tuple[np.ndarray, np.ndarray]:
    """The held-out test set shared by every site."""
    _, x_test, _, y_test = _train_test()
    return x_test, y_test


def _packed_rows(location: str) -> tuple[np.ndarray, np.ndarray]:
    from hybridfleet.data import open_dataset

    dataset = open_dataset(location)
    rows = dataset.take(np.arange(len(dataset)))
    x = (rows["pixels"].reshape(len(dataset), -1) / 16.0).astype(np.float32)
    return x, rows["label"].astype(np.int64)


def split_rows(name: str) -> tuple[np.ndarray, np.ndarray]:
    """All training rows of the named split ``digits:site-a`` or ``digits:site-b``."""
    x, _, y, _ = _train_test()
    rng = np.random.default_rng(SEED)
    to_a = np.where(y < 5, rng.random(len(y)) < MAJORITY_FRACTION, rng.random(len(y)) >= MAJORITY_FRACTION)
    part = {"digits:site-a": to_a, "digits:site-b": ~to_a}.get(name)
    if part is None:
        raise ValueError(f"unknown site data {name!r}: use digits:site-a, digits:site-b or a packed dataset")
    idx = np.flatnonzero(part)
    return x[idx], y[idx]


def load_site(name: str, shard: int = 0, num_shards: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of site data ``name`` (a named split or a packed dataset), then this worker's 1/num_shards of them."""
    if name.startswith("digits:"):
        x, y = split_rows(name)
    else:
        x, y = _packed_rows(name)
    return x[shard::num_shards], y[shard::num_shards]
