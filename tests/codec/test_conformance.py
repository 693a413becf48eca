"""The conformance suite every codec in CODECS and WIRE_CODECS must pass (parametrised by `codec_name`)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hybridfleet.codec import LOSSLESS_CODECS, ErrorFeedback, get_codec
from hybridfleet.codec.frame import CODEC_IDS
from hybridfleet.errors import ProtocolError

EPS32 = float(np.finfo(np.float32).eps)
SHAPE_OFFSET = 6  # magic (2) + version + codec id + dtype code + ndim


def _gradient(rng, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


# --- round trips ---------------------------------------------------------------------------


def test_round_trip_is_within_the_codec_bound(make_codec, rng, within_bound):
    # Prepare
    codec = make_codec()
    x = _gradient(rng, (64, 257)) * np.float32(3)

    # Execute
    payload = codec.encode(x)

    # Assert
    within_bound(codec, x, payload)


def test_round_trip_keeps_a_chunk_of_mixed_magnitudes_within_bound(make_codec, rng, within_bound):
    # Prepare: magnitudes across eight decades, the case relative bounds are about
    codec = make_codec()
    x = (_gradient(rng, 5000) * np.float32(10.0) ** rng.integers(-6, 2, 5000)).astype(np.float32)

    # Execute
    payload = codec.encode(x)

    # Assert
    within_bound(codec, x, payload)


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)])
def test_empty_tensor_round_trips_with_its_shape(make_codec, shape):
    # Prepare
    codec = make_codec()
    x = np.zeros(shape, dtype=np.float32)

    # Execute
    decoded = codec.decode(codec.encode(x))
    sparse = codec.decode_sparse(codec.encode(x))

    # Assert
    assert decoded.shape == shape and decoded.dtype == np.float32
    assert sparse.indices.size == 0 and sparse.values.size == 0 and sparse.shape == shape


def test_scalar_round_trips_as_shape_empty(make_codec, within_bound):
    # Prepare
    codec = make_codec()
    x = np.array(-1.75, dtype=np.float32)

    # Execute
    payload = codec.encode(x)

    # Assert
    assert codec.decode(payload).shape == ()
    within_bound(codec, x, payload)


def test_numpy_scalar_is_encoded_like_a_zero_dim_array(make_codec):
    # Prepare
    codec = make_codec()

    # Execute
    payload = codec.encode(np.float32(2.5))

    # Assert
    assert codec.decode(payload).shape == ()


def test_huge_tensor_round_trips_within_bound(make_codec, rng, within_bound):
    # Prepare
    codec = make_codec()
    x = _gradient(rng, 4 * 1024 * 1024)

    # Execute
    payload = codec.encode(x)

    # Assert
    within_bound(codec, x, payload)


def test_strided_view_encodes_exactly_like_its_contiguous_copy(make_codec, rng):
    # Prepare: a transposed, step-sliced view (neither C- nor F-contiguous)
    base = _gradient(rng, (40, 90))
    view = base.T[::3, 1::2]
    assert not view.flags.c_contiguous and not view.flags.f_contiguous

    # Execute
    from_view = make_codec().encode(view)
    from_copy = make_codec().encode(np.ascontiguousarray(view))

    # Assert
    assert from_view == from_copy
    np.testing.assert_array_equal(make_codec().decode(from_view), make_codec().decode(from_copy))


def test_decoded_array_is_writable(make_codec, rng):
    # Prepare
    payload = make_codec().encode(_gradient(rng, (8, 8)))

    # Execute
    decoded = make_codec().decode(payload)
    decoded += 1

    # Assert
    assert decoded.flags.writeable


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_float16_and_float64_inputs_keep_their_dtype(make_codec, codec_name, rng, dtype):
    # Prepare
    x = _gradient(rng, (33, 17), dtype)

    # Execute
    decoded = make_codec().decode(make_codec().encode(x))

    # Assert: `none` is exact in every dtype; lossy codecs compute in float32
    assert decoded.dtype == dtype and decoded.shape == x.shape
    if codec_name in LOSSLESS_CODECS:
        np.testing.assert_array_equal(decoded, x)
    else:
        via_float32 = make_codec().decode(make_codec().encode(x.astype(np.float32)))
        np.testing.assert_array_equal(decoded, via_float32.astype(dtype))


@pytest.mark.parametrize("bad", [np.arange(4), np.ones(3, dtype=np.complex64), np.ones(2, dtype=bool)])
def test_non_float_dtype_is_rejected_with_message(make_codec, codec_name, bad):
    # Execute / Assert
    with pytest.raises(TypeError, match=rf"codec '{codec_name}' encodes float16, float32, float64 arrays \(got {bad.dtype}\)"):
        make_codec().encode(bad)


def test_non_array_input_is_rejected_with_message(make_codec, codec_name):
    with pytest.raises(TypeError, match=rf"codec '{codec_name}' encodes numpy arrays \(got list\)"):
        make_codec().encode([1.0, 2.0])


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_non_finite_gradient_is_rejected_with_message(make_codec, codec_name, poison):
    # Prepare
    x = np.ones(10, dtype=np.float32)
    x[4] = poison

    # Execute / Assert
    with pytest.raises(ValueError, match=rf"codec '{codec_name}' cannot encode a gradient holding NaN or Inf"):
        make_codec().encode(x)


def test_float64_beyond_float32_range_is_rejected_by_lossy_codecs(make_codec, codec_name):
    # Prepare
    x = np.array([1.0, 1e300])

    # Execute / Assert
    if codec_name in LOSSLESS_CODECS:
        np.testing.assert_array_equal(make_codec().decode(make_codec().encode(x)), x)
    else:
        with pytest.raises(ValueError, match="computes in float32; the gradient holds values beyond its range"):
            make_codec().encode(x)


def test_decode_sparse_scatters_to_the_dense_decode(make_codec, rng):
    # Prepare
    payload = make_codec().encode(_gradient(rng, (50, 20)))
    codec = make_codec()

    # Execute
    sparse = codec.decode_sparse(payload)
    dense = codec.decode(payload)

    # Assert
    assert sparse.indices.dtype == np.int64 and (np.diff(sparse.indices) > 0).all()
    rebuilt = np.zeros(sparse.shape, dtype=sparse.values.dtype)
    rebuilt.reshape(-1)[sparse.indices] = sparse.values
    np.testing.assert_array_equal(rebuilt, dense)


def test_payload_decodes_with_a_codec_built_from_the_name_alone(codec_name, rng):
    # Prepare: the sender uses non-default options
    options = {
        "int8": {"chunk_size": 100},
        "int4": {"chunk_size": 50},
        "sign": {"chunk_size": 33},
        "topk": {"ratio": 0.3, "index_coding": "int32"},
        "randomk": {"ratio": 0.2, "seed": 1, "scale": True},
    }.get(codec_name, {})
    sender = get_codec(codec_name, **options)
    payload = sender.encode(_gradient(rng, 1000))

    # Execute
    decoded = get_codec(codec_name).decode(payload)

    # Assert
    np.testing.assert_array_equal(decoded, sender.decode(payload))


def test_options_rebuild_an_equivalent_codec(make_codec, codec_name, rng):
    # Prepare
    codec = make_codec()

    # Execute
    rebuilt = get_codec(codec_name, **codec.options())

    # Assert
    x = _gradient(rng, 300)
    assert rebuilt.options() == codec.options()
    assert rebuilt.encode(x) == codec.encode(x)


def test_encoded_size_counts_framing_and_stays_below_dense_for_lossy_codecs(make_codec, codec_name, rng):
    # Prepare
    x = _gradient(rng, 100_000)

    # Execute
    nbytes = len(make_codec().encode(x))

    # Assert
    assert nbytes > x.nbytes if codec_name in LOSSLESS_CODECS else nbytes < x.nbytes


# --- error feedback --------------------------------------------------------------------------


def test_error_feedback_identity_holds_at_every_step(make_codec, rng):
    # Prepare
    feedback = ErrorFeedback(make_codec())
    decoder = make_codec()
    old_residual = np.zeros((30, 40), dtype=np.float32)

    for _ in range(6):
        grad = _gradient(rng, (30, 40))

        # Execute
        decoded = decoder.decode(feedback.encode("w", grad))
        new_residual = feedback.residual("w")

        # Assert: decoded + new residual == grad + old residual
        expected = grad + old_residual
        np.testing.assert_allclose(decoded + new_residual, expected, rtol=0, atol=4 * EPS32 * np.abs(expected).max())
        old_residual = new_residual


def test_error_feedback_sum_of_decoded_tracks_sum_of_gradients(make_codec, rng):
    # Prepare
    steps = 20
    feedback = ErrorFeedback(make_codec())
    decoder = make_codec()
    sum_decoded = np.zeros(500)
    sum_grads = np.zeros(500)

    # Execute
    for _ in range(steps):
        grad = _gradient(rng, 500)
        sum_decoded += decoder.decode(feedback.encode("w", grad))
        sum_grads += grad

    # Assert: nothing is lost, only delayed
    total = sum_decoded + feedback.residual("w")
    np.testing.assert_allclose(total, sum_grads, rtol=0, atol=steps * 8 * EPS32 * np.abs(sum_grads).max())


# --- malformed payloads ----------------------------------------------------------------------


def _payload(make_codec, rng) -> bytes:
    return make_codec().encode(_gradient(rng, (12, 50)))


@pytest.mark.parametrize("keep_bytes", [0, 3, 7, 20, -1])
def test_truncated_payload_is_rejected_with_message(make_codec, codec_name, rng, keep_bytes):
    # Prepare
    payload = _payload(make_codec, rng)
    cut = payload[:keep_bytes]

    # Execute / Assert
    with pytest.raises(ProtocolError, match=rf"{codec_name} payload truncated"):
        make_codec().decode(cut)


def test_trailing_bytes_are_rejected_with_message(make_codec, codec_name, rng):
    payload = _payload(make_codec, rng) + b"\x00"
    with pytest.raises(ProtocolError, match=rf"{codec_name} payload has trailing bytes"):
        make_codec().decode(payload)


def test_payload_of_another_codec_is_rejected_naming_both(make_codec, codec_name, rng):
    # Prepare: flip the codec id byte to the next codec's id
    payload = bytearray(_payload(make_codec, rng))
    names = sorted(CODEC_IDS, key=CODEC_IDS.get)
    other = names[(names.index(codec_name) + 1) % len(names)]
    payload[3] = CODEC_IDS[other]

    # Execute / Assert
    with pytest.raises(ProtocolError, match=rf"encoded by codec '{other}' .*but this decoder is '{codec_name}'"):
        make_codec().decode(bytes(payload))
    with pytest.raises(ProtocolError, match="unknown codec id 200"):
        payload[3] = 200
        make_codec().decode_sparse(bytes(payload))


def test_shape_that_disagrees_with_the_body_is_rejected_with_message(make_codec, codec_name, rng):
    # Prepare: announce 2 x 50 elements where the body holds 12 x 50
    payload = bytearray(_payload(make_codec, rng))
    struct.pack_into("<I", payload, SHAPE_OFFSET, 2)

    # Execute / Assert
    pattern = (
        rf"{codec_name} payload(: [\w ]+ field holds \d+ bytes, expected \d+"
        r"| announces \d+ values for a tensor of 100 elements"
        r"|: index( gap)? \d+ is out of range for 100 elements)"
    )
    with pytest.raises(ProtocolError, match=pattern):
        make_codec().decode(bytes(payload))


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, ord("X"), "does not start with the frame magic"),
        (2, 9, "has frame version 9; this side speaks version 1"),
        (4, 77, "has unknown dtype code 77"),
        (5, 99, "has ndim 99; at most 32 is allowed"),
    ],
)
def test_corrupt_header_byte_is_rejected_with_message(make_codec, codec_name, rng, offset, value, message):
    payload = bytearray(_payload(make_codec, rng))
    payload[offset] = value
    with pytest.raises(ProtocolError, match=rf"{codec_name} payload {message}"):
        make_codec().decode(bytes(payload))


@pytest.mark.parametrize("shape", [(64, 257), (0,), ()])
def test_encode_parts_sends_a_frame_like_encode_makes(make_codec, rng, within_bound, shape):
    # Prepare
    codec = make_codec()
    x = _gradient(rng, shape)
    before = x.copy()
    deterministic = bytes(codec.encode(x)) == bytes(codec.encode(x))  # randomk draws its coordinates anew

    # Execute
    parts = codec.encode_parts(x)

    # Assert: a frame within the codec's bound (byte for byte encode's where encode is deterministic),
    # and the input untouched
    frame = bytes(parts)
    assert len(parts) == len(frame)
    within_bound(codec, x, frame)
    assert frame == bytes(codec.encode(x)) or not deterministic
    np.testing.assert_array_equal(x, before)
