"""The OIP body codec reads and writes what the standard library's json would: orjson is the fast
path, every body orjson refuses is read by the standard library (so no request's answer changed),
and a response holds the same values, non-finite ones written as the standard library writes them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridfleet.serve.protocol import InferRequestError, TensorCodec
from hybridfleet.serve.runtime import TensorSpec

CODEC = TensorCodec([TensorSpec("input", "FP32", (-1, 4)), TensorSpec("ids", "INT64", (-1, 2))],
                    [TensorSpec("output", "FP32", (-1, 3))])  # fmt: skip


def _body(values: str, ids: str = "[1, 2]") -> bytes:
    return ('{"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": ' + values + '}, '
            '{"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": ' + ids + '}], "id": "r1"}').encode()  # fmt: skip


@pytest.mark.parametrize("body", [
    _body("[0.1, -2.5e-7, 3, 1e38]"),
    _body("[[0.1, 0.2, 0.3, 0.4]]", "[[9223372036854775807, -9223372036854775808]]"),
    _body("[0.1, 0.2, 0.3, 0.4]").decode().encode("utf-16"),  # the standard library reads UTF-16 bodies; orjson does not
    _body("[0.1, 0.2, 0.3, 0.4]").replace(b'"id": "r1"', b'"id": "r1", "id": "r2"'),  # the last of two keys wins in both
])  # fmt: skip
def test_a_request_parses_to_the_arrays_the_standard_library_reading_gives(body):
    # Prepare: the arrays built from the standard library's reading of the body
    doc = json.loads(body)
    want = {item["name"]: np.asarray(item["data"], dtype=np.float32 if item["datatype"] == "FP32" else np.int64)
            for item in doc["inputs"]}  # fmt: skip
    # Execute
    got = CODEC.parse(body, None)
    # Assert: the same values, dtypes and id
    assert got.id == doc["id"]
    for name, array in want.items():
        assert got.inputs[name].dtype == array.dtype
        np.testing.assert_array_equal(got.inputs[name].reshape(-1), array.reshape(-1))


@pytest.mark.parametrize("body,message", [
    (_body("[NaN, 0, 0, 0]"), "input 'input': data holds NaN or infinity"),
    (_body("[1e400, 0, 0, 0]"), "input 'input': data holds NaN or infinity"),
    (_body("[0, 0, 0, -Infinity]"), "input 'input': data holds NaN or infinity"),
    (_body("[0, 0, 0, 0]", "[18446744073709551616, 1]"), "values that are not integers"),
    (b"[" * 50_000 + b"]" * 50_000, "request body is not JSON: nested too deeply"),
    (b'{"inputs": [}', "request body is not JSON: Expecting value"),
    (b"\xff\xfe\x00", "request body is not JSON"),
])  # fmt: skip
def test_a_body_orjson_refuses_gets_the_standard_library_reading_and_its_reason(body, message):
    with pytest.raises(InferRequestError) as refused:
        CODEC.parse(body, None)
    assert message in str(refused.value)


@pytest.mark.parametrize("values,ids,message", [
    ("[1.0, true, 0, 0]", "[1, 2]", "input 'input': the model takes float32 and the data holds JSON booleans"),
    ("[[false, 0.5, 0, 0]]", "[1, 2]", "input 'input': the model takes float32 and the data holds JSON booleans"),
    ("[true, false, true, false]", "[1, 2]", "input 'input': the model takes float32 (numbers) and the data holds booleans"),
    ('["1.5", 0, 0, 0]', "[1, 2]", "input 'input': the model takes float32 (numbers) and the data holds strings"),
    ("[null, 0, 0, 0]", "[1, 2]", "input 'input': the model takes float32 (numbers) and the data holds integers and nulls"),
    ("[0, 0, 0, 0]", "[1, true]", "input 'ids': the model takes int64 and the data holds JSON booleans"),
    ("[0, 0, 0, 0]", '["1", 2]', "input 'ids': the model takes int64 and the data holds values that are not integers (strings)"),
])  # fmt: skip
def test_values_a_cast_would_silently_change_are_refused_with_what_they_are(values, ids, message):
    # a boolean among numbers: numpy alone reads true as 1; a string: numpy alone parses "1.5" as 1.5
    with pytest.raises(InferRequestError) as refused:
        CODEC.parse(_body(values, ids), None)
    assert message in str(refused.value)


def test_numbers_are_read_alike_with_and_without_a_boolean_elsewhere_in_the_request():
    # the per-value look for booleans runs only when the JSON holds true or false somewhere (here: a parameter)
    plain = CODEC.parse(_body("[0.5, 1, -2, 3e3]"), None)
    flagged = CODEC.parse(_body("[0.5, 1, -2, 3e3]").replace(b'"id": "r1"', b'"id": "r1", "parameters": {"x": true}'), None)
    for got in (plain, flagged):
        np.testing.assert_array_equal(got.inputs["input"], np.float32([[0.5, 1, -2, 3e3]]))
        np.testing.assert_array_equal(got.inputs["ids"], np.int64([[1, 2]]))


def test_integers_past_int64_are_read_exactly_for_an_unsigned_input_and_refused_past_its_range():
    codec = TensorCodec([TensorSpec("u", "UINT64", (-1, 2)), TensorSpec("flag", "BOOL", (-1, 2))],
                        [TensorSpec("output", "FP32", (-1, 3))])  # fmt: skip

    def body(u: str, flag: str = "[true, false]") -> bytes:
        return ('{"inputs": [{"name": "u", "shape": [1, 2], "datatype": "UINT64", "data": ' + u + '}, '
                '{"name": "flag", "shape": [1, 2], "datatype": "BOOL", "data": ' + flag + '}]}').encode()  # fmt: skip

    got = codec.parse(body("[9223372036854775808, 1]"), None)
    assert got.inputs["u"].tolist() == [[2**63, 1]] and got.inputs["flag"].tolist() == [[True, False]]
    for u, flag, message in [("[-1, 1]", "[true, false]", "input 'u': values outside uint64's range"),
                             ("[1, 2]", "[1, 0]", "input 'flag': the model takes bool (booleans) and the data holds integers")]:
        with pytest.raises(InferRequestError) as refused:
            codec.parse(body(u, flag), None)
        assert message in str(refused.value)


@pytest.mark.parametrize("values", [
    [[0.1, -2.5e-7, 3.0]],
    [[np.float32(1) / 3, 1e-45, 3.4028235e38]],
    [[float("nan"), float("inf"), -float("inf")]],  # written as the standard library writes them, not as null
])  # fmt: skip
def test_a_response_holds_the_values_the_standard_library_would_write(values):
    request = CODEC.parse(_body("[0, 0, 0, 0]"), None)
    outputs = {"output": np.asarray(values, dtype=np.float32)}
    body, header_length = CODEC.encode("m", 3, request, outputs)
    want = {"model_name": "m", "model_version": "3", "outputs": [{"name": "output", "datatype": "FP32", "shape": [1, 3],
            "data": outputs["output"].reshape(-1).tolist()}], "id": "r1"}  # fmt: skip
    assert header_length is None
    assert repr(json.loads(body)) == repr(want)  # every float exactly, nan and inf included
    if not np.isfinite(outputs["output"]).all():
        assert body == json.dumps(want, separators=(",", ":")).encode()  # NaN and Infinity, as before (orjson: null)
