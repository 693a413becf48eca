"""Behaviour particular to each codec, the registry, and option checks."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from hybridfleet.codec import CODECS, SPARSE_CODECS, WIRE_CODECS, codec_for, codec_options, get_codec, read_header
from hybridfleet.codec.frame import CODEC_IDS
from hybridfleet.codec.indices import DELTA, INT32, delta_nbytes, encode_indices, smaller_coding
from hybridfleet.codec.sparse import kept_count
from hybridfleet.errors import ProtocolError
from hybridfleet.spec.models import CompressionSpec


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def _fields(payload: bytes) -> tuple[int, list[tuple[int, int]]]:
    """Offset of the field table and (offset, length) of each field."""
    ndim = payload[5]
    table = 6 + 4 * ndim + 1
    count = payload[table - 1]
    lengths = struct.unpack_from(f"<{count}Q", payload, table)
    offset = table + 8 * count
    spans = []
    for length in lengths:
        spans.append((offset, length))
        offset += length
    return table, spans


def _replace_field(payload: bytes, index: int, body: bytes) -> bytes:
    table, spans = _fields(payload)
    out = bytearray(payload[: spans[0][0]])
    struct.pack_into("<Q", out, table + 8 * index, len(body))
    for i, (offset, length) in enumerate(spans):
        out += body if i == index else payload[offset : offset + length]
    return bytes(out)


# --- registry --------------------------------------------------------------------------------


def test_registry_names_match_the_job_spec_choices():
    assert set(CODECS) == set(CompressionSpec.model_fields["codec"].annotation.__args__)
    assert set(CODECS) | set(WIRE_CODECS) == set(CODEC_IDS) and not set(CODECS) & set(WIRE_CODECS)


def test_unknown_codec_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown codec 'zstd'; valid codecs: none, fp16, bf16, int8, topk, randomk, sign, int4"):
        get_codec("zstd")


def test_unknown_option_names_the_codec_and_its_options():
    with pytest.raises(ValueError, match=r"codec 'fp16' takes no option 'ratio' \(its options: none\)"):
        get_codec("fp16", ratio=0.1)
    with pytest.raises(ValueError, match=r"codec 'int8' takes no option 'chunk' \(its options: chunk_size\)"):
        get_codec("int8", chunk=8)


def test_codec_for_spec_passes_ratio_only_to_sparse_codecs():
    # Prepare
    sparse = CompressionSpec(codec="topk", ratio=0.05)
    dense = CompressionSpec(codec="int8", ratio=0.05)

    # Execute
    topk, int8 = codec_for(sparse), codec_for(dense)

    # Assert
    assert topk.name == "topk" and topk.ratio == 0.05
    assert int8.name == "int8" and "ratio" not in codec_options("int8")
    assert SPARSE_CODECS == ("topk", "randomk")


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("topk", {"ratio": 0}, r"topk: ratio must be a number in \(0, 1\] \(got 0\)"),
        ("randomk", {"ratio": 1.5}, r"randomk: ratio must be a number in \(0, 1\] \(got 1.5\)"),
        ("topk", {"ratio": "0.1"}, r"topk: ratio must be a number in \(0, 1\] \(got '0.1'\)"),
        ("topk", {"index_coding": "zip"}, r"topk: index_coding must be one of auto, int32, delta \(got 'zip'\)"),
        ("int8", {"chunk_size": 0}, r"int8: chunk_size must be an integer in \[1, 4294967295\] \(got 0\)"),
        ("sign", {"chunk_size": 2.5}, r"sign: chunk_size must be an integer in \[1, 4294967295\] \(got 2.5\)"),
        ("randomk", {"seed": -1}, r"randomk: seed must be a non-negative integer or None \(got -1\)"),
        ("randomk", {"scale": "yes"}, r"randomk: scale must be true or false \(got 'yes'\)"),
    ],
)
def test_bad_option_is_rejected_with_message(name, options, message):
    with pytest.raises(ValueError, match=message):
        get_codec(name, **options)


def test_read_header_reports_codec_dtype_and_shape_without_decoding(rng):
    # Prepare
    payload = get_codec("topk", ratio=0.1).encode(rng.standard_normal((7, 3)))

    # Execute
    header, _ = read_header(payload)

    # Assert
    assert (header.codec_name, header.dtype, header.shape, header.numel) == ("topk", np.float64, (7, 3), 21)


# --- dense codecs ----------------------------------------------------------------------------


def test_fp16_saturates_beyond_its_range_instead_of_overflowing():
    x = np.array([1e6, -1e6, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(get_codec("fp16").decode(get_codec("fp16").encode(x)), [65504.0, -65504.0, 3.0])


def test_bf16_rounds_half_way_cases_to_even():
    # Prepare: bfloat16 keeps 7 mantissa bits, so 2**-8 is half a step at 1.0
    codec = get_codec("bf16")
    halfway_down = 1 + 2.0**-8  # between 1 and 1 + 2**-7: the even neighbour is 1
    halfway_up = 1 + 3 * 2.0**-8  # between 1 + 2**-7 and 1 + 2**-6: the even one is 1 + 2**-6
    above_half = 1 + 2.0**-8 + 2.0**-20
    x = np.array([halfway_down, halfway_up, above_half, -halfway_down], dtype=np.float32)

    # Execute
    decoded = codec.decode(codec.encode(x))

    # Assert
    np.testing.assert_array_equal(decoded, np.array([1.0, 1 + 2.0**-6, 1 + 2.0**-7, -1.0], dtype=np.float32))


def test_bf16_saturates_at_its_largest_finite_value():
    x = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], dtype=np.float32)
    decoded = get_codec("bf16").decode(get_codec("bf16").encode(x))
    assert np.isfinite(decoded).all() and decoded[0] == -decoded[1] > 3.3e38


def test_int8_chunk_of_zeros_decodes_exactly_and_others_use_their_own_scale():
    # Prepare: chunk 0 tiny values, chunk 1 zeros, chunk 2 large values
    codec = get_codec("int8", chunk_size=4)
    x = np.array([1e-6, -2e-6, 3e-6, 0, 0, 0, 0, 0, 500, -250, 125, 1], dtype=np.float32)

    # Execute
    decoded = codec.decode(codec.encode(x))

    # Assert: the tiny chunk is not drowned by the large one
    np.testing.assert_array_equal(decoded[4:8], 0)
    np.testing.assert_allclose(decoded[:3], x[:3], rtol=1 / 127)
    assert decoded[8] == 500


def test_int4_codes_are_the_nearest_of_fifteen_levels_per_chunk():
    # Prepare: chunk 0 spans [-7, 7] exactly, chunk 1 is zeros, chunk 2 tiny values, odd length
    codec = get_codec("int4", chunk_size=4)
    x = np.array([7.0, -7.0, 3.4, -0.6, 0, 0, 0, 0, 1e-6, -2e-6, 7e-7], dtype=np.float32)

    # Execute
    payload = codec.encode(x)
    decoded = codec.decode(payload)

    # Assert: 11 elements in 6 code bytes; each value rounds to its chunk's grid of absmax / 7
    table, spans = _fields(payload)
    assert spans[2][1] == 6
    np.testing.assert_array_equal(decoded[:8], [7.0, -7.0, 3.0, -1.0, 0, 0, 0, 0])
    # 1e-6 / (2e-6 / 7) = 3.5 rounds half to even (4), 7e-7 / (2e-6 / 7) = 2.45 rounds to 2
    np.testing.assert_allclose(decoded[8:], np.array([4, -7, 2]) * np.float32(2e-6) / 7, rtol=1e-6)


@pytest.mark.parametrize(
    ("field", "body", "message"),
    [
        (1, struct.pack("<f", float("nan")), "int4 payload has a NaN or Inf scale"),
        (1, struct.pack("<f", float("inf")), "int4 payload has a NaN or Inf scale"),
        (1, struct.pack("<f", -1.0), "int4 payload has a negative scale"),
        (2, bytes([0x11, 0x11, 0x11, 0x11, 0x08]), "int4 payload has the code -8; codes lie in \\[-7, 7\\]"),
        (2, bytes([0x11, 0x11, 0x11, 0x11, 0x11]), "int4 payload has a non-zero padding nibble after the last element"),
        (2, bytes([0x11] * 4), r"int4 payload: codes field holds 4 bytes, expected 5 \(5 x uint8\)"),
    ],
)
def test_int4_hostile_payload_is_rejected_with_message(field, body, message):
    # Prepare: 9 elements in one chunk -> one scale, 5 code bytes
    codec = get_codec("int4")
    payload = codec.encode(np.linspace(-1, 1, 9, dtype=np.float32))

    # Execute / Assert
    with pytest.raises(ProtocolError, match=message):
        codec.decode(_replace_field(payload, field, body))


def test_int4_frame_cannot_make_the_decoder_allocate_beyond_the_caller_plan():
    # Prepare: a tiny frame whose header announces 2**31 elements
    payload = bytearray(get_codec("int4").encode(np.ones(8, dtype=np.float32)))
    struct.pack_into("<I", payload, 6, 2**31)

    # Execute / Assert: refused on the element count before any array is built
    with pytest.raises(ProtocolError, match=r"int4 payload shape \(2147483648,\) has 2147483648 elements, expected 8"):
        get_codec("int4").decode(bytes(payload), expected_numel=8)


def test_sign_decodes_zero_as_positive_scale():
    codec = get_codec("sign", chunk_size=4)
    decoded = codec.decode(codec.encode(np.array([0.0, -2.0, 4.0, -2.0], dtype=np.float32)))
    np.testing.assert_array_equal(decoded, [2.0, -2.0, 2.0, -2.0])


def test_sign_payload_with_set_padding_bits_is_rejected():
    payload = get_codec("sign").encode(np.ones(5, dtype=np.float32))
    corrupt = payload[:-1] + bytes([0b1000_0000])
    with pytest.raises(ProtocolError, match="sign payload has non-zero padding bits after the last element"):
        get_codec("sign").decode(corrupt)


@pytest.mark.parametrize("name", ["int8", "int4", "sign"])
def test_chunked_payload_with_zero_chunk_size_is_rejected(name):
    payload = get_codec(name).encode(np.ones(5, dtype=np.float32))
    corrupt = _replace_field(payload, 0, struct.pack("<I", 0))
    with pytest.raises(ProtocolError, match=f"{name} payload has chunk_size 0; it must be >= 1"):
        get_codec(name).decode(corrupt)


@pytest.mark.parametrize("name", ["int8", "fp16", "bf16", "none", "topk"])
def test_payload_carrying_non_finite_values_is_rejected(name):
    # Prepare: overwrite the values (or int8 scales) with NaN / Inf bit patterns
    codec = get_codec(name)
    payload = codec.encode(np.ones(4, dtype=np.float32))
    field, body = {
        "int8": (1, struct.pack("<f", float("inf"))),
        "fp16": (0, np.full(4, np.nan, "<f2").tobytes()),
        "bf16": (0, np.full(4, 0x7FC0, "<u2").tobytes()),
        "none": (0, np.full(4, np.inf, "<f4").tobytes()),
        "topk": (2, np.full(1, np.nan, "<f4").tobytes()),
    }[name]

    # Execute / Assert
    with pytest.raises(ProtocolError, match=f"{name} payload decodes to NaN or Inf values"):
        codec.decode(_replace_field(payload, field, body))


# --- sparse codecs ---------------------------------------------------------------------------


def test_kept_count_ignores_float_noise_in_ratio_times_numel():
    assert kept_count(0.07, 100) == 7
    assert kept_count(0.071, 100) == 8
    assert kept_count(1e-9, 10) == 1
    assert kept_count(0.5, 0) == 0


def test_topk_keeps_the_largest_magnitudes_of_either_sign():
    codec = get_codec("topk", ratio=0.3)
    x = np.array([0.1, -9.0, 0.2, 5.0, -0.3, 0.0, 7.0, 0.4, -0.5, 0.6], dtype=np.float32)
    sparse = codec.decode_sparse(codec.encode(x))
    np.testing.assert_array_equal(sparse.indices, [1, 3, 6])
    np.testing.assert_array_equal(sparse.values, [-9.0, 5.0, 7.0])


@pytest.mark.parametrize("name", SPARSE_CODECS)
def test_index_codings_decode_to_the_same_update_and_auto_picks_the_shorter(name, rng):
    # Prepare
    x = rng.standard_normal(20_000).astype(np.float32)
    payloads = {c: get_codec(name, ratio=0.02, index_coding=c, seed=3) if name == "randomk" else get_codec(name, ratio=0.02, index_coding=c) for c in ("int32", "delta", "auto")}

    # Execute
    encoded = {c: codec.encode(x) for c, codec in payloads.items()}

    # Assert
    decoded = {c: get_codec(name).decode(p) for c, p in encoded.items()}
    np.testing.assert_array_equal(decoded["int32"], decoded["delta"])
    assert len(encoded["auto"]) == min(len(encoded["int32"]), len(encoded["delta"]))


def test_auto_index_coding_picks_int32_when_gaps_are_large():
    # Prepare: 3 indices far apart need 5-byte varints but 4 bytes as int32
    indices = np.array([2**30, 2**31, 2**32 - 2], dtype=np.int64)

    # Execute
    nbytes = delta_nbytes(indices)

    # Assert
    assert nbytes > 4 * indices.size
    assert smaller_coding(indices) == INT32
    assert smaller_coding(np.arange(0, 1000, 7)) == DELTA
    assert encode_indices(indices, INT32).size == 4 * indices.size
    assert encode_indices(indices, DELTA).size == nbytes


def test_randomk_with_a_seed_repeats_its_sequence_of_subsets(rng):
    # Prepare
    x = rng.standard_normal(5000).astype(np.float32)
    first, second = get_codec("randomk", ratio=0.01, seed=5), get_codec("randomk", ratio=0.01, seed=5)

    # Execute
    run_a = [first.decode_sparse(first.encode(x)).indices for _ in range(3)]
    run_b = [second.decode_sparse(second.encode(x)).indices for _ in range(3)]

    # Assert: same sequence across instances, fresh subset on every call
    for a, b in zip(run_a, run_b):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(run_a[0], run_a[1])


def test_randomk_scaled_multiplies_kept_values_by_numel_over_k():
    x = np.arange(1, 101, dtype=np.float32)
    codec = get_codec("randomk", ratio=0.1, seed=0, scale=True)
    sparse = codec.decode_sparse(codec.encode(x))
    np.testing.assert_allclose(sparse.values, x[sparse.indices] * (100 / 10), rtol=1e-6)


def _topk_payload(index_coding: str) -> bytes:
    x = np.arange(1, 201, dtype=np.float32)  # top-10 of 200 = indices 190..199
    return get_codec("topk", ratio=0.05, index_coding=index_coding).encode(x)


def test_sparse_payload_with_out_of_range_index_is_rejected():
    payload = _replace_field(_topk_payload("int32"), 1, np.arange(195, 205, dtype="<u4").tobytes())
    with pytest.raises(ProtocolError, match="topk payload: index 204 is out of range for 200 elements"):
        get_codec("topk").decode(payload)


def test_sparse_payload_with_repeated_index_is_rejected():
    indices = np.array([1, 2, 3, 3, 4, 5, 6, 7, 8, 9], dtype="<u4")
    payload = _replace_field(_topk_payload("int32"), 1, indices.tobytes())
    with pytest.raises(ProtocolError, match="topk payload: indices are not strictly increasing"):
        get_codec("topk").decode_sparse(payload)


def test_sparse_payload_announcing_more_values_than_elements_is_rejected():
    payload = _replace_field(_topk_payload("int32"), 0, struct.pack("<IB", 201, INT32))
    with pytest.raises(ProtocolError, match="topk payload announces 201 values for a tensor of 200 elements"):
        get_codec("topk").decode(payload)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (bytes([0x80] * 10), "indices field ends inside a varint"),
        (bytes([1] * 9), "indices field holds 9 varints, expected 10"),
        (bytes([0xFF] * 5 + [0x01] + [0] * 9), "a varint in the indices field is longer than 5 bytes"),
        (bytes([250, 1] + [0] * 9), "index gap 250 is out of range for 200 elements"),
        (b"", "indices field is empty but 10 values are announced"),
    ],
)
def test_malformed_delta_indices_are_rejected_with_message(body, message):
    payload = _replace_field(_topk_payload("delta"), 1, body)
    with pytest.raises(ProtocolError, match=f"topk payload: {message}"):
        get_codec("topk").decode(payload)


def test_sparse_payload_with_unknown_index_coding_is_rejected():
    payload = _replace_field(_topk_payload("delta"), 0, struct.pack("<IB", 10, 7))
    with pytest.raises(ProtocolError, match=r"topk payload has unknown index coding 7 \(known: \[0, 1\]\)"):
        get_codec("topk").decode(payload)


def test_payload_with_wrong_field_count_is_rejected():
    payload = bytearray(get_codec("fp16").encode(np.ones(3, dtype=np.float32)))
    table, _ = _fields(bytes(payload))
    payload[table - 1] = 2
    with pytest.raises(ProtocolError, match="fp16 payload has 2 fields, expected 1"):
        get_codec("fp16").decode(bytes(payload))


def test_sign_payload_with_negative_scale_is_rejected():
    payload = get_codec("sign", chunk_size=4).encode(np.ones(4, dtype=np.float32))
    corrupt = _replace_field(payload, 1, struct.pack("<f", -1.0))
    with pytest.raises(ProtocolError, match="sign payload has a negative scale"):
        get_codec("sign").decode(corrupt)


def test_importing_the_codec_package_imports_no_framework():
    # Prepare: a fresh interpreter, so modules imported by other tests do not count
    code = "import sys, hybridfleet.codec; print(sorted({'torch', 'paddle'} & set(sys.modules)))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    # Execute
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)

    # Assert
    assert result.stdout.strip() == "[]"


def test_sparse_codecs_with_float16_values_are_smaller_and_decode_without_options():
    from hybridfleet.codec import ErrorFeedback, get_codec

    x = np.random.default_rng(3).standard_normal(100_000).astype(np.float32)
    for name in ("topk", "randomk"):
        wide, narrow = get_codec(name, ratio=0.01), get_codec(name, ratio=0.01, value_dtype="float16")
        payload = narrow.encode(x)
        assert len(payload) < 0.8 * len(wide.encode(x))
        sparse = get_codec(name).decode_sparse(payload)  # no options needed to decode
        exact = x[sparse.indices]
        assert (np.abs(sparse.values - exact) <= 2.0**-11 * np.abs(exact) + 2.0**-25).all()
    # error feedback keeps what the float16 rounding lost
    feedback = ErrorFeedback(get_codec("topk", ratio=0.01, value_dtype="float16"))
    payload = feedback.encode("w", x)
    np.testing.assert_allclose(get_codec("topk").decode(payload) + feedback.residual("w"), x, rtol=0, atol=1e-6)


def test_unknown_value_dtype_is_refused():
    from hybridfleet.codec import get_codec

    with pytest.raises(ValueError, match="value_dtype must be one of float32, float16"):
        get_codec("topk", value_dtype="int4")
