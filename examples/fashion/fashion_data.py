"""Fashion-MNIST split across two sites whose classes and scanners differ.

Debian's ``dataset-fashion-mnist`` ships the 60,000 training and 10,000 test images
(``apt-get install dataset-fashion-mnist``; IDX files under /usr/share/datasets/fashion-mnist,
or the folder named by ``FASHION_MNIST_DIR``), so nothing is downloaded.

The training images are split non-IID, seeded:

- by class: site A ("hospital") holds 90% of the images of classes 0-4 and 10% of
  classes 5-9, site B ("cloud") the rest, so each site alone barely sees half the classes;
- by scanner: each site's images go through its own brightness/contrast shift
  (`SCANNERS`), applied when the site's dataset is packed, as two hospitals' scanners differ.

The test set is t10k, every other image seen through site A's scanner and the others
through site B's: the joint model must serve both sites. ``split_rows("fashion:all")``
is both sites' rows together, for training alone on all the data.

A site's data is a packed dataset (``examples/fashion/data/site-a``, written by
``python examples/fashion/pack_sites.py`` with ``hfleet data pack``) or a named split
``fashion:site-a`` / ``fashion:site-b`` / ``fashion:all`` computed here.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

SEED = 0
MAJORITY_FRACTION = 0.9
IMAGE_SIDE = 28
NUM_CLASSES = 10
INSTALL_HINT = "apt-get install dataset-fashion-mnist"
# site -> (contrast, brightness): pixel' = clip(contrast * pixel + brightness), pixels in 0..255
SCANNERS = {"site-a": (0.7, 60.0), "site-b": (1.0, 0.0)}
# IDX magic numbers: 0x0000 0x08 (unsigned byte) then the number of dimensions
IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
MAX_IDX_BYTES = 1 << 28  # far above Fashion-MNIST's 47 MB; a header asking for more is not this data set


def data_dir() -> Path:
    """The folder holding the four IDX files (``FASHION_MNIST_DIR`` or Debian's location)."""
    return Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array of a gzipped IDX file whose header carries ``magic``.

    Refuses, with a ValueError naming the file, a wrong magic number, a header that asks
    for more than `MAX_IDX_BYTES`, and a body shorter or longer than the header says; the
    body is read only after its length is known. A missing file raises FileNotFoundError
    naming the Debian package that installs it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Fashion-MNIST is not installed here ({INSTALL_HINT}, "
                                "or set FASHION_MNIST_DIR to the folder holding its IDX files)")
    ndim = magic & 0xFF
    with gzip.open(path, "rb") as f:
        try:
            header = f.read(4)
            if len(header) < 4 or int.from_bytes(header, "big") != magic:
                found = header.hex() if len(header) == 4 else f"{len(header)} bytes"
                raise ValueError(f"{path}: not an IDX file of {ndim} dimension(s): magic {found}, "
                                 f"expected {magic:08x}")
            dims_raw = f.read(4 * ndim)
            if len(dims_raw) < 4 * ndim:
                raise ValueError(f"{path}: truncated IDX header ({len(dims_raw)} of {4 * ndim} dimension bytes)")
            dims = [int.from_bytes(dims_raw[i:i + 4], "big") for i in range(0, 4 * ndim, 4)]
            size = int(np.prod(dims, dtype=np.int64))
            if size > MAX_IDX_BYTES:
                raise ValueError(f"{path}: IDX header asks for {dims} = {size} bytes, over {MAX_IDX_BYTES}")
            body = f.read(size)
            extra = len(f.read(1))
        except (OSError, EOFError) as err:  # a gzip stream cut short or corrupted
            raise ValueError(f"{path}: not a readable gzip file ({err}); reinstall with {INSTALL_HINT}") from None
    if len(body) != size:
        raise ValueError(f"{path}: truncated: the header says {dims} ({size} bytes), the file holds {len(body)}")
    if extra:
        raise ValueError(f"{path}: {dims} ({size} bytes) in the header, but more bytes follow")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def load_raw(part: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) int64 of ``part`` (``train`` or ``t10k``)."""
    images = read_idx(data_dir() / f"{part}-images-idx3-ubyte.gz", IMAGES_MAGIC)
    labels = read_idx(data_dir() / f"{part}-labels-idx1-ubyte.gz", LABELS_MAGIC)
    if images.shape[1:] != (IMAGE_SIDE, IMAGE_SIDE) or len(images) != len(labels):
        raise ValueError(f"{data_dir()}: {part} holds {images.shape} images and {len(labels)} labels; "
                         f"expected N x {IMAGE_SIDE} x {IMAGE_SIDE} images and N labels")
    if labels.max(initial=0) >= NUM_CLASSES:
        raise ValueError(f"{data_dir()}: {part} labels must be 0..{NUM_CLASSES - 1} (found {labels.max()})")
    return images, labels.astype(np.int64)


def scan(images: np.ndarray, site: str) -> np.ndarray:
    """``images`` (uint8) as site ``site``'s scanner sees them (`SCANNERS`), uint8."""
    contrast, brightness = SCANNERS[site]
    return np.clip(np.rint(images.astype(np.float32) * contrast + brightness), 0, 255).astype(np.uint8)


def site_of_rows(labels: np.ndarray) -> np.ndarray:
    """For each training row, True when it belongs to site A (seeded, non-IID by class)."""
    rng = np.random.default_rng(SEED)
    draw = rng.random(len(labels))
    return np.where(labels < NUM_CLASSES // 2, draw < MAJORITY_FRACTION, draw >= MAJORITY_FRACTION)


def split_rows(name: str, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Training images (uint8, as the site's scanner sees them) and labels of split ``name``.

    ``name`` is ``fashion:site-a``, ``fashion:site-b`` or ``fashion:all`` (both sites' rows,
    each through its own scanner, in training-file order); ``rows`` keeps only the first
    ``rows`` rows of each site (the same rows in ``fashion:all``).
    """
    sites = {"fashion:site-a": ["site-a"], "fashion:site-b": ["site-b"], "fashion:all": ["site-a", "site-b"]}
    if name not in sites:
        raise ValueError(f"unknown site data {name!r}: use {', '.join(sites)} or a packed dataset")
    if rows is not None and rows < 1:
        raise ValueError(f"rows: must be >= 1 (got {rows})")
    images, labels = load_raw("train")
    to_a = site_of_rows(labels)
    index, pixels = [], []
    for site in sites[name]:
        idx = np.flatnonzero(to_a if site == "site-a" else ~to_a)[:rows]
        index.append(idx)
        pixels.append(scan(images[idx], site))
    order = np.argsort(np.concatenate(index), kind="stable")  # training-file order
    return np.concatenate(pixels)[order], labels[np.concatenate(index)][order]


def to_float(pixels: np.ndarray) -> np.ndarray:
    """uint8 pixels (N, 28, 28) as the models' float32 input (N, 1, 28, 28) in [0, 1]."""
    return (pixels.reshape(-1, 1, IMAGE_SIDE, IMAGE_SIDE) / 255.0).astype(np.float32)


def load_test(rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The shared test set: t10k (its first ``rows`` rows), even rows through site A's scanner,
    odd rows through site B's; float32 (N, 1, 28, 28) and int64 labels."""
    images, labels = load_raw("t10k")
    images, labels = images[:rows], labels[:rows]
    pixels = np.where((np.arange(len(images)) % 2 == 0)[:, None, None], scan(images, "site-a"), scan(images, "site-b"))
    return to_float(pixels), labels


def load_site(name: str, shard: int = 0, num_shards: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of site data ``name`` (a named split or a packed dataset) as float32 (N, 1, 28, 28)
    and int64 labels, then this worker's 1/num_shards of them."""
    if name.startswith("fashion:"):
        pixels, y = split_rows(name)
    else:
        from hybridfleet.data import open_dataset

        dataset = open_dataset(name)
        rows = dataset.take(np.arange(len(dataset)))
        pixels, y = rows["pixels"], rows["label"].astype(np.int64)
    return to_float(pixels[shard::num_shards]), y[shard::num_shards]
