"""Python's own standard library as a corpus, split across sites by package.

The text is the non-test ``.py`` source of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), so nothing is downloaded. The vocabulary is the
256 byte values, the same for both frameworks. Each site holds a group of packages,
the way two organisations hold different code; a third group is held out as the
common test set. Every split is deterministic: files are read in a seeded order.

    site-a (the hospital): email, http, json, xml, html, urllib, wsgiref, xmlrpc
    site-b (the cloud):    asyncio, concurrent, multiprocessing, logging, importlib, unittest, sqlite3, ctypes
    held out (test):       collections, re, tomllib, dbm, venv, ensurepip

A site's data is either a packed dataset (``examples/charlm/data/site-a``, made by
``python examples/charlm/pack_sites.py`` with ``hfleet data pack``: rows of
``window`` bytes, column ``window``) or the named split ``charlm:site-a`` /
``charlm:site-b`` / ``charlm:all`` computed here.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

SEED = 0
VOCAB = 256
WINDOW = 129  # context 128 + the next byte of each position
SITE_PACKAGES = {
    "site-a": ("email", "http", "json", "xml", "html", "urllib", "wsgiref", "xmlrpc"),
    "site-b": ("asyncio", "concurrent", "multiprocessing", "logging", "importlib", "unittest", "sqlite3", "ctypes"),
}
TEST_PACKAGES = ("collections", "re", "tomllib", "dbm", "venv", "ensurepip")
TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(packages: tuple[str, ...], root: Path | None = None) -> list[Path]:
    """The non-test ``.py`` files of ``packages`` (packages or top-level modules), in a seeded order."""
    root = root or stdlib_root()
    files: list[Path] = []
    for name in packages:
        if (root / name).is_dir():
            files += [p for p in sorted((root / name).rglob("*.py"))
                      if not TEST_DIRS & set(p.relative_to(root).parts[:-1])]
        elif (root / f"{name}.py").is_file():
            files.append(root / f"{name}.py")
    if not files:
        raise ValueError(f"none of the packages {', '.join(packages)} is in the standard library at {root}")
    order = np.random.default_rng(SEED).permutation(len(files))
    return [files[i] for i in order]


def corpus(packages: tuple[str, ...], max_bytes: int | None = None) -> bytes:
    """The files of ``packages`` joined by newlines (seeded order), cut to ``max_bytes`` when given."""
    out, size = [], 0
    for path in source_files(packages):
        data = path.read_bytes() + b"\n"
        out.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def windows(text: bytes, window: int = WINDOW) -> np.ndarray:
    """Consecutive, non-overlapping ``window``-byte rows of ``text`` (uint8, shape (rows, window));
    the tail shorter than a window is dropped."""
    if window < 2:
        raise ValueError(f"window must be >= 2 bytes (got {window})")
    rows = len(text) // window
    if rows == 0:
        raise ValueError(f"the text ({len(text)} bytes) is shorter than one window of {window} bytes")
    return np.frombuffer(text[:rows * window], dtype=np.uint8).reshape(rows, window).copy()


def split_rows(name: str, max_bytes: int | None = None, window: int = WINDOW) -> np.ndarray:
    """The windows of the named split ``charlm:site-a``, ``charlm:site-b`` or ``charlm:all`` (the rows of
    both sites together, for training alone on all the data); ``max_bytes`` cuts each site's text."""
    if name == "charlm:all":
        return np.concatenate([split_rows(f"charlm:{site}", max_bytes, window) for site in SITE_PACKAGES])
    packages = SITE_PACKAGES.get(name.removeprefix("charlm:")) if name.startswith("charlm:") else None
    if packages is None:
        raise ValueError(f"unknown site data {name!r}: use charlm:site-a, charlm:site-b, charlm:all "
                         "or a packed dataset")
    return windows(corpus(packages, max_bytes), window)


def load_test(context: int, max_bytes: int) -> np.ndarray:
    """The held-out test set: ``context + 1``-byte windows of the first ``max_bytes`` of the test packages."""
    return windows(corpus(TEST_PACKAGES, max_bytes), context + 1)


def load_site(name: str, shard: int = 0, num_shards: int = 1) -> np.ndarray:
    """Windows of site data ``name`` (a named split or a packed dataset), then this worker's 1/num_shards of them."""
    if name.startswith("charlm:"):
        rows = split_rows(name)
    else:
        from hybridfleet.data import open_dataset

        dataset = open_dataset(name)
        rows = np.asarray(dataset.take(np.arange(len(dataset)))["window"], dtype=np.uint8).reshape(len(dataset), -1)
    return rows[shard::num_shards]


def sample_batch(rows: np.ndarray, batch_size: int, context: int, rng: np.random.Generator) -> np.ndarray:
    """``batch_size`` random crops of ``context + 1`` bytes from random rows (int64, shape (batch, context + 1))."""
    if rows.shape[1] < context + 1:
        raise ValueError(f"the packed windows hold {rows.shape[1]} bytes; context {context} needs {context + 1}: "
                         "pack with a larger --window or train with a smaller --context")
    picks = rng.integers(0, len(rows), batch_size)
    starts = rng.integers(0, rows.shape[1] - context, batch_size)
    return np.stack([rows[r, s:s + context + 1] for r, s in zip(picks, starts)]).astype(np.int64)
