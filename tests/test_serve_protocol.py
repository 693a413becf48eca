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
