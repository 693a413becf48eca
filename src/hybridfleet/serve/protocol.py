"""Open Inference Protocol v2 REST bodies: parse an infer request, encode its response.

JSON tensors (``data`` nested or flat, row-major) and the binary tensor data extension
that Triton's clients use by default (``Inference-Header-Content-Length``: a JSON header,
then each binary input's raw little-endian bytes in order, sized by its
``parameters.binary_data_size``). Every size is checked against the model's declared
tensors and the request's own length before an array is built; a bad request is an
`InferRequestError` with the message the client sees (HTTP 400).

Bodies are read and written with orjson: at batch 1 the standard library's parser spent
about as long on a 784-value image as onnxruntime spent on the model (bench/serve.py).
What orjson refuses and the standard library reads (integers past 64 bits, ``NaN`` and
``Infinity``, UTF-16/32 bodies) is read by the standard library, so such a request gets
the same answer as before (the checks below refuse it with the reason); a response
holding NaN or infinity is written by the standard library too (orjson would write null).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from hybridfleet.serve.runtime import NUMPY_DTYPES, TensorSpec

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_ELEMENTS = 16 * 1024 * 1024  # per input tensor: 64 MiB of FP32


class InferRequestError(ValueError):
    """An infer request this model cannot take; the message is returned as ``{"error": ...}``."""


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] | None = None  # requested names; None: all
    binary_outputs: set[str] = field(default_factory=set)


class TensorCodec:
    """The OIP REST codec of one model's signature: `parse` a request against its input and output
    tensors, `encode` its outputs. Built once per loaded model, so a request looks up only what
    varies: the tensors it names."""

    def __init__(self, specs: list[TensorSpec], output_specs: list[TensorSpec]):
        # name -> (spec, little-endian wire dtype, native dtype)
        self._inputs = {s.name: (s, np.dtype(NUMPY_DTYPES[s.datatype]).newbyteorder("<"),
                                 np.dtype(NUMPY_DTYPES[s.datatype]).newbyteorder("=")) for s in specs}
        self._input_names = ", ".join(self._inputs)
        self._required = [s.name for s in specs]
        self._outputs = [s.name for s in output_specs]
        self._known_outputs = set(self._outputs)
        self._datatypes = {s.name: s.datatype for s in output_specs}

    def parse(self, body: bytes, header_length: str | None) -> InferRequest:
        """The request in ``body`` checked against the model's input and output tensors."""
        if header_length is not None:
            try:
                n = int(header_length)
            except ValueError:
                raise InferRequestError(f"{HEADER_LENGTH} must be an integer (got {header_length!r})") from None
            if not 0 < n <= len(body):
                raise InferRequestError(f"{HEADER_LENGTH} {n} is outside the body's {len(body)} bytes")
            head, raw = body[:n], memoryview(body)[n:]
        else:
            head, raw = body, memoryview(b"")
        doc = _loads(head)
        may_hold_booleans = b"true" in head or b"false" in head
        if type(doc) is not dict or type(doc.get("inputs")) is not list:
            raise InferRequestError("request must be a JSON object with an 'inputs' list")
        parameters = doc.get("parameters") or {}
        if type(parameters) is not dict:
            raise InferRequestError("'parameters' must be an object")
        inputs: dict[str, np.ndarray] = {}
        offset = 0
        for item in doc["inputs"]:
            if type(item) is not dict:
                raise InferRequestError("each input must be an object with name, shape, datatype, data")
            name = item.get("name")
            known = self._inputs.get(name) if isinstance(name, str) else None
            if known is None:
                raise InferRequestError(f"unknown input {name!r}; this model takes {self._input_names}")
            spec, wire, native = known
            if name in inputs:
                raise InferRequestError(f"input {name!r} given twice")
            shape = _shape(item.get("shape"), spec)
            if item.get("datatype") != spec.datatype:
                raise InferRequestError(f"input {name!r}: datatype {item.get('datatype')!r}, the model takes {spec.datatype}")
            item_parameters = item.get("parameters")
            if item_parameters is not None and type(item_parameters) is not dict:
                raise InferRequestError(f"input {name!r}: 'parameters' must be an object")
            size = item_parameters.get("binary_data_size") if item_parameters else None
            if size is not None:
                count = math.prod(shape)
                if type(size) is not int or size != count * wire.itemsize:
                    raise InferRequestError(f"input {name!r}: binary_data_size {size!r} != {count} x {wire.itemsize} bytes of shape {shape}")
                if offset + size > len(raw):
                    raise InferRequestError(f"input {name!r}: {size} binary bytes announced, {len(raw) - offset} left in the body")
                array = np.frombuffer(raw[offset:offset + size], dtype=wire).reshape(shape).astype(native)
                offset += size
            else:
                array = _from_json(item.get("data"), native, shape, name, may_hold_booleans)
            inputs[name] = array
        if offset != len(raw):
            raise InferRequestError(f"{len(raw) - offset} bytes of binary data after the last binary input")
        if len(inputs) != len(self._required):
            missing = [n for n in self._required if n not in inputs]
            raise InferRequestError(f"missing input(s): {', '.join(missing)}")
        requested = doc.get("outputs")
        names: list[str] | None = None
        binary: set[str] = set(self._known_outputs) if parameters.get("binary_data_output") is True else set()
        if requested is not None:
            if type(requested) is not list or not all(type(o) is dict for o in requested):
                raise InferRequestError("'outputs' must be a list of objects with a name")
            names = []
            binary = set()
            for o in requested:
                name = o.get("name")
                if not isinstance(name, str) or name not in self._known_outputs:
                    raise InferRequestError(f"unknown output {name!r}; this model gives {', '.join(sorted(self._known_outputs))}")
                output_parameters = o.get("parameters")
                if output_parameters is not None and type(output_parameters) is not dict:
                    raise InferRequestError(f"output {name!r}: 'parameters' must be an object")
                names.append(name)
                if output_parameters and output_parameters.get("binary_data") is True:
                    binary.add(name)
        request_id = doc.get("id")
        return InferRequest(inputs, str(request_id) if request_id is not None else None, parameters, names, binary)

    def encode(self, model_name: str, version: int, request: InferRequest,
               outputs: dict[str, np.ndarray]) -> tuple[bytes, int | None]:  # fmt: skip
        """(response body, JSON header length when binary outputs follow, else None)."""
        items, blobs = [], []
        for name in request.outputs or self._outputs:
            array = np.ascontiguousarray(outputs[name])
            item: dict[str, Any] = {"name": name, "datatype": self._datatypes[name], "shape": list(array.shape)}
            if name in request.binary_outputs:
                blob = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
                item["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                item["data"] = array.reshape(-1).tolist()
            items.append(item)
        doc: dict[str, Any] = {"model_name": model_name, "model_version": str(version), "outputs": items}
        if request.id is not None:
            doc["id"] = request.id
        head = orjson.dumps(doc)
        if b"null" in head and not all(np.isfinite(outputs[item["name"]]).all() for item in items if "data" in item):
            head = json.dumps(doc, separators=(",", ":")).encode()  # orjson wrote NaN or infinity as null
        if not blobs:
            return head, None
        return head + b"".join(blobs), len(head)


def _loads(head: bytes) -> Any:
    """The JSON document in ``head``: orjson's reading, or the standard library's where orjson refuses."""
    try:
        return orjson.loads(head)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(head)
    except RecursionError:
        raise InferRequestError("request body is not JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise InferRequestError(f"request body is not JSON: {err}") from None


def _shape(shape: Any, spec: TensorSpec) -> tuple[int, ...]:
    if type(shape) is list and len(shape) == len(spec.shape):  # the common case, checked in one pass
        for got, want in zip(shape, spec.shape):
            if type(got) is not int or got < 0 or (want != -1 and want != got):
                break
        else:
            if shape and shape[0] == 0 or math.prod(shape) > MAX_ELEMENTS:
                return _refuse_shape(shape, spec)
            return tuple(shape)
    return _refuse_shape(shape, spec)


def _refuse_shape(shape: Any, spec: TensorSpec) -> tuple[int, ...]:
    """Raise the InferRequestError that says what is wrong with ``shape`` for ``spec``."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InferRequestError(f"input {spec.name!r}: shape must be a list of non-negative integers (got {shape!r})")
    if len(shape) != len(spec.shape) or any(want not in (-1, got) for want, got in zip(spec.shape, shape)):
        raise InferRequestError(f"input {spec.name!r}: shape {shape} does not fit the model's {list(spec.shape)}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise InferRequestError(f"input {spec.name!r}: {math.prod(shape)} elements is over the limit of {MAX_ELEMENTS}")
    if shape and shape[0] == 0:
        raise InferRequestError(f"input {spec.name!r}: the batch is empty")
    return tuple(shape)  # fits (an int subclass the fast path does not take)


def _from_json(data: Any, dtype: np.dtype, shape: tuple[int, ...], name: str, may_hold_booleans: bool = True) -> np.ndarray:
    """``data`` as an array of ``dtype`` (native byte order) and ``shape``, all values finite.

    Refuses what a cast would silently change: strings ("1.5" is not read as 1.5), JSON
    booleans for a numeric input (true is not 1) and numbers for a BOOL input, fractions for an
    integer input (1.5 is not 1), integers outside its range (300 is not 44 in INT8).
    ``may_hold_booleans``: False when the request's JSON has no ``true`` or ``false`` at all,
    which spares looking at each value for one (numpy reads a boolean among numbers as 1 or 0)."""
    if data is None:
        raise InferRequestError(f"input {name!r}: no 'data' and no binary_data_size parameter")
    try:
        raw = np.asarray(data)
    except (TypeError, ValueError, OverflowError) as err:
        raise InferRequestError(f"input {name!r}: data is not a list of {dtype.name} values ({err})") from None
    if raw.size:
        raw = _checked_kinds(raw, data, dtype, name, may_hold_booleans)
    if raw.size != math.prod(shape):
        raise InferRequestError(f"input {name!r}: {raw.size} values for shape {list(shape)} ({math.prod(shape)} expected)")
    if dtype.kind in "iu" and raw.size:
        limits = np.iinfo(dtype)
        if raw.min() < limits.min or raw.max() > limits.max:
            raise InferRequestError(f"input {name!r}: values outside {dtype.name}'s range {limits.min}..{limits.max}")
    with np.errstate(over="ignore"):  # a number beyond the input's float range becomes infinity, refused below
        array = raw.astype(dtype.newbyteorder("="), copy=False)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InferRequestError(f"input {name!r}: data holds NaN or infinity (or a value beyond {dtype.name}'s range)")
    return array.reshape(shape)


# what JSON values numpy's reading of them may give, by the kind of the model's input
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_KIND_WORDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers", "U": "strings"}
_TYPE_WORDS = {bool: "booleans", int: "integers", float: "numbers", str: "strings", dict: "objects", type(None): "nulls"}


def _holds(raw: np.ndarray) -> str:
    """What the JSON values numpy read as ``raw`` are, in words."""
    if raw.dtype.kind != "O":
        return _KIND_WORDS.get(raw.dtype.kind, f"JSON {raw.dtype.name} values")
    kinds = {type(v) for v in raw.reshape(-1)}
    if kinds == {int}:
        return "integers beyond 64 bits"
    return " and ".join(sorted(_TYPE_WORDS.get(k, k.__name__) for k in kinds))


def _checked_kinds(raw: np.ndarray, data: Any, dtype: np.dtype, name: str, may_hold_booleans: bool) -> np.ndarray:
    """``raw`` (numpy's reading of ``data``) when its values are of the kind the input takes."""
    if raw.dtype.kind == "O" and dtype.kind == "f":  # integers beyond 64 bits among the numbers
        values = raw.reshape(-1)
        if all(type(v) in (int, float) for v in values):
            return np.asarray(values.tolist(), dtype=np.float64).reshape(raw.shape)
        may_hold_booleans = False  # the message below names what the data holds
    if raw.dtype.kind in "fO" and dtype.kind in "iu":  # numpy reads integers past int64's range as floats or objects
        values = np.asarray(data, dtype=object).reshape(-1)
        if all(type(v) is int for v in values):
            limits = np.iinfo(dtype)
            if min(values) < limits.min or max(values) > limits.max:
                raise InferRequestError(f"input {name!r}: values outside {dtype.name}'s range {limits.min}..{limits.max}")
            return np.asarray(values.tolist(), dtype=dtype).reshape(raw.shape)
    allowed = _JSON_KINDS.get(dtype.kind, "iuf")
    if raw.dtype.kind not in allowed:
        got = _holds(raw)
        if dtype.kind in "iu":
            raise InferRequestError(f"input {name!r}: the model takes {dtype.name} and the data holds values that are "
                                    f"not integers ({got})")  # fmt: skip
        raise InferRequestError(f"input {name!r}: the model takes {dtype.name} ({_KIND_WORDS.get(dtype.kind, 'numbers')}) and the data "
                                f"holds {got}")  # fmt: skip
    if dtype.kind != "b" and may_hold_booleans:
        values = np.asarray(data, dtype=object).reshape(-1)
        if any(type(v) is bool for v in values):
            raise InferRequestError(f"input {name!r}: the model takes {dtype.name} and the data holds JSON booleans "
                                    "(true is not read as 1)")  # fmt: skip
    return raw
