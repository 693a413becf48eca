"""Host-buffer snapshots: the copy an async save makes while training waits."""

from __future__ import annotations

import numpy as np

from hybridfleet.ckpt.snapshot import STREAM_MIN_BYTES, HostBuffers, copy_into


def test_host_buffers_copy_large_and_small_tensors_exactly_and_detached():
    # Prepare: tensors above and below the streaming threshold, odd sizes, a non-contiguous view
    rng = np.random.default_rng(3)
    big = rng.standard_normal(STREAM_MIN_BYTES // 4 * 3 + 13, dtype=np.float32)
    tensors = {
        "big": big,
        "big_f16": rng.standard_normal(STREAM_MIN_BYTES + 7).astype(np.float16),
        "small": rng.integers(0, 9, size=(5, 3), dtype=np.int64),
        "strided": rng.standard_normal((64, 32))[:, ::2],
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    expected = {k: v.copy() for k, v in tensors.items()}
    buffers = HostBuffers()

    copies = buffers.copy("tensors", tensors)
    big += 1.0  # training goes on changing the originals

    for name, arr in expected.items():
        np.testing.assert_array_equal(copies[name], arr, err_msg=name)
        assert copies[name].dtype == arr.dtype and copies[name].shape == arr.shape


def test_copy_into_an_unaligned_slice_touches_only_that_slice():
    src = np.arange(STREAM_MIN_BYTES + 1001, dtype=np.uint8)
    dst = np.zeros(src.size + 10, dtype=np.uint8)

    copy_into(dst[3 : 3 + src.size], src)

    np.testing.assert_array_equal(dst[3 : 3 + src.size], src)
    assert not dst[:3].any() and not dst[3 + src.size :].any()
