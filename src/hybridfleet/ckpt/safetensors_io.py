"""safetensors encoding and decoding on numpy arrays, without copying tensor bytes.

`encode` returns the header followed by each array's own buffer, so a writer can
stream them (and hash them) straight from the arrays; `decode` returns numpy views
into one buffer (a memory map for local files), after the safetensors library's own
parser has accepted the header (so offsets that overlap, leave gaps or overrun the
file are refused exactly as the reference reader refuses them). Tensors are ordered by item size,
largest first, after a 64-byte-aligned header, so every tensor starts aligned to its
item size. The files are plain safetensors, readable by `safetensors.safe_open`.

bfloat16 tensors (safetensors "BF16") are numpy arrays of ``ml_dtypes.bfloat16``, numpy
having no bfloat16 of its own: the bytes are the framework's own, bit for bit.
"""

from __future__ import annotations

import json
import struct
import tempfile
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from hybridfleet.errors import CheckpointError
from hybridfleet.store.base import Buffer

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPE_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
CODE_DTYPES = {code: BFLOAT16 if name == "bfloat16" else np.dtype(name) for name, code in DTYPE_CODES.items()}
HEADER_ALIGN_BYTES = 64
MAX_HEADER_BYTES = 100 << 20


def _little_endian_contiguous(name: str, arr: Any) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.name not in DTYPE_CODES:
        raise CheckpointError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored; supported: {sorted(DTYPE_CODES)}")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def encode(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> list[Buffer]:
    """safetensors bytes of ``tensors`` as [header, tensor buffers...] (concatenate to get the file)."""
    arrays = {name: _little_endian_contiguous(name, arr) for name, arr in tensors.items()}
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        arr = arrays[name]
        header[name] = {"dtype": DTYPE_CODES[arr.dtype.name], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN_BYTES)
    parts: list[Buffer] = [struct.pack("<Q", len(raw)) + raw]
    parts += [memoryview(arrays[name].reshape(-1).view(np.uint8)) for name in order if arrays[name].nbytes]
    return parts


def validate_header(head: Buffer, total_bytes: int, source: str = "safetensors file") -> None:
    """Let the safetensors library judge a file from its first bytes (length + header) and its size.

    The library opens a sparse stand-in of ``total_bytes`` bytes holding only ``head``,
    so no tensor bytes are read or copied. Raises CheckpointError with the library's reason.
    """
    with tempfile.NamedTemporaryFile(prefix="hfleet-st-", suffix=".safetensors") as stand_in:
        stand_in.write(head)
        stand_in.truncate(total_bytes)
        stand_in.flush()
        try:
            with safetensors.safe_open(stand_in.name, framework="numpy"):
                pass
        except (safetensors.SafetensorError, ValueError, OSError) as err:
            raise CheckpointError(f"{source}: not a valid safetensors file ({err})") from err


def decode(buffer: Buffer, source: str = "safetensors file") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> numpy view into ``buffer``, metadata) of a safetensors file.

    Raises CheckpointError naming ``source`` (and the tensor) for a malformed file:
    whatever the safetensors library refuses, and dtypes numpy cannot view.
    """
    view = memoryview(buffer).cast("B")
    if view.nbytes < 8:
        raise CheckpointError(f"{source}: too short to be a safetensors file ({view.nbytes} bytes)")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > min(MAX_HEADER_BYTES, view.nbytes - 8):
        raise CheckpointError(f"{source}: header length {header_len} exceeds the file")
    validate_header(view[: 8 + header_len], view.nbytes, source)
    header = json.loads(bytes(view[8 : 8 + header_len]))
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if info["dtype"] not in CODE_DTYPES:
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {info['dtype']}; readable: {sorted(CODE_DTYPES)}")
        dtype = CODE_DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin = int(info["data_offsets"][0])
        count = int(np.prod(shape, dtype=np.int64))
        tensors[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin).reshape(shape)
    return tensors, metadata
