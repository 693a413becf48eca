"""Fixtures shared by the codec tests: one codec per name and each codec's documented bound."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from hybridfleet.codec import CODECS, LOSSLESS_CODECS, WIRE_CODECS, get_codec

# randomk is seeded so two fresh instances draw the same subsets.
OPTIONS = {"randomk": {"seed": 7}}


@pytest.fixture(params=CODECS + WIRE_CODECS)
def codec_name(request) -> str:
    return request.param


@pytest.fixture
def make_codec(codec_name):
    """A factory of fresh, identically configured codecs of the parametrised name."""
    return lambda: get_codec(codec_name, **OPTIONS.get(codec_name, {}))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


def _chunks(values: np.ndarray, chunk_size: int) -> list[np.ndarray]:
    flat = values.reshape(-1)
    return [flat[i : i + chunk_size] for i in range(0, flat.size, chunk_size)]


def assert_within_bound(codec, x: np.ndarray, payload: bytes) -> None:
    """Assert that `payload = codec.encode(x)` decodes within the documented bound of `codec`."""
    y = codec.decode(payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    x = x.astype(np.float64).reshape(-1)
    y = y.astype(np.float64).reshape(-1)
    if codec.name in LOSSLESS_CODECS:
        np.testing.assert_array_equal(y, x)
    elif codec.name == "fp16":
        assert (np.abs(y - x) <= 2.0**-11 * np.abs(x) + 2.0**-25).all()
    elif codec.name == "bf16":
        assert (np.abs(y - x) <= 2.0**-8 * np.abs(x) + 1e-38).all()
    elif codec.name == "int8":
        for xc, yc in zip(_chunks(x, codec.chunk_size), _chunks(y, codec.chunk_size)):
            half_step = np.abs(xc).max() / 254
            assert (np.abs(yc - xc) <= half_step * (1 + 1e-5) + 1e-30).all()
    elif codec.name == "int4":
        for xc, yc in zip(_chunks(x, codec.chunk_size), _chunks(y, codec.chunk_size)):
            half_step = np.abs(xc).max() / 14
            assert (np.abs(yc - xc) <= half_step * (1 + 1e-5) + 1e-30).all()
    elif codec.name in ("topk", "randomk"):
        k = min(x.size, max(1, math.ceil(codec.ratio * x.size - 1e-6))) if x.size else 0
        kept = codec.decode_sparse(payload).indices
        assert kept.size == k and np.unique(kept).size == k
        np.testing.assert_array_equal(y[kept], x[kept].astype(np.float32))
        np.testing.assert_array_equal(np.delete(y, kept), 0)
        if codec.name == "topk" and kept.size:
            dropped = np.setdiff1d(np.arange(x.size), kept)
            if dropped.size:
                assert np.abs(x[kept]).min() >= np.abs(x[dropped]).max()
    elif codec.name == "sign":
        for xc, yc in zip(_chunks(x, codec.chunk_size), _chunks(y, codec.chunk_size)):
            np.testing.assert_allclose(np.abs(yc), np.abs(xc).mean(), rtol=1e-5)
            assert (np.sign(yc[xc != 0]) == np.sign(xc[xc != 0])).all()
    elif codec.name == "powersgd":
        # a projection P P^T M onto an orthonormal P: never larger than the input; dense frames are exact
        from hybridfleet.codec.frame import unpack_frame

        rank = struct.unpack("<III", unpack_frame(payload, "powersgd", 4).fields[0])[2]
        if rank == 0:
            np.testing.assert_array_equal(y, x.astype(np.float32))
        else:
            assert np.linalg.norm(y - x) <= np.linalg.norm(x) * (1 + 1e-5)
    else:
        raise AssertionError(f"no bound written for codec {codec.name!r}")


@pytest.fixture
def within_bound():
    return assert_within_bound
