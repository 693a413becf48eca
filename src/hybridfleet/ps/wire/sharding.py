"""Which parameter-server shard owns which parameter, or which block of it.

A tensor larger than ``block_size_bytes`` is cut into contiguous flat element ranges
("blocks", keys ``"<param>#<i>"``) of near-equal size; smaller tensors stay whole (key ==
parameter name). Blocks are then placed largest first onto the least-loaded shard (ties
go to the lowest shard index), which keeps any two shards' loads within one block size
of each other.

The plan depends only on (parameter specs, number of shards, block size): parameters are
put in name order before anything else, so every worker and shard that builds it gets
the same plan, and `ShardingPlan.digest` lets them check that they do.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

PLAN_FORMAT_VERSION = 1
BLOCK_SEPARATOR = "#"

ITEMSIZE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class ParamSpec:
    """A named tensor to place: its shape (``()`` for a scalar) and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"parameter name: must be a non-empty string (got {self.name!r})")
        if BLOCK_SEPARATOR in self.name:
            raise ValueError(f"parameter {self.name!r}: names may not contain {BLOCK_SEPARATOR!r} "
                             f"(it separates a parameter from its block index)")
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError):
            raise ValueError(f"parameter {self.name!r}: shape must be a sequence of integers "
                             f"(got {self.shape!r})") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"parameter {self.name!r}: shape dimensions must be >= 0 (got {shape})")
        if self.dtype not in ITEMSIZE_BYTES:
            raise ValueError(f"parameter {self.name!r}: dtype must be one of "
                             f"{', '.join(sorted(ITEMSIZE_BYTES))} (got {self.dtype!r})")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return ITEMSIZE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Block:
    """Flat elements ``[start, stop)`` of ``param``, owned by ``shard`` under ``key``."""

    key: str
    param: str
    shard: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        """Number of elements in the block."""
        return self.stop - self.start


def matrix_rows(plan: "ShardingPlan", key: str) -> int | None:
    """The rows block ``key`` spans when its parameter is viewed as ``(shape[0], rest)``: 1 for a
    vector or scalar parameter, None when the block cuts through a row (or ``key`` is unknown).

    A low-rank codec (powersgd) encodes the block as that matrix; None leaves it its own layout.
    """
    try:
        block = plan.block(key)
    except ValueError:
        return None
    shape = plan.params[block.param].shape
    if len(shape) <= 1:
        return 1
    cols = math.prod(shape[1:])
    if cols == 0 or block.start % cols or block.stop % cols:
        return None
    return max(1, block.numel // cols)


def _cut(spec: ParamSpec, block_size_bytes: int) -> list[tuple[str, int, int]]:
    """(key, start, stop) of each block of ``spec``: whole, or near-equal contiguous pieces."""
    if spec.nbytes <= block_size_bytes:
        return [(spec.name, 0, spec.numel)]
    per_block = block_size_bytes // spec.itemsize
    num_blocks = -(-spec.numel // per_block)
    bounds = [i * spec.numel // num_blocks for i in range(num_blocks + 1)]
    return [(f"{spec.name}{BLOCK_SEPARATOR}{i}", bounds[i], bounds[i + 1]) for i in range(num_blocks)]


def _refuse_duplicate_names(params: list[ParamSpec]) -> None:
    duplicates = sorted(name for name, n in Counter(p.name for p in params).items() if n > 1)
    if duplicates:
        raise ValueError(f"params: duplicate parameter names {duplicates}")


class ShardingPlan:
    """The placement of every parameter block on a shard; build it with `ShardingPlan.build`."""

    def __init__(self, params: Iterable[ParamSpec], blocks: Iterable[Block], num_shards: int,
                 block_size_bytes: int) -> None:
        params = sorted(params, key=lambda p: p.name)
        _refuse_duplicate_names(params)
        self.params: dict[str, ParamSpec] = {p.name: p for p in params}
        self.blocks: list[Block] = sorted(blocks, key=lambda b: (b.param, b.start, b.key))
        self.num_shards = num_shards
        self.block_size_bytes = block_size_bytes
        self._check_consistent()
        self._by_key = {b.key: b for b in self.blocks}
        self._by_param: dict[str, list[Block]] = {}
        for block in self.blocks:
            self._by_param.setdefault(block.param, []).append(block)

    @classmethod
    def build(cls, params: list[ParamSpec], num_shards: int, block_size_bytes: int) -> ShardingPlan:
        """Split and place ``params`` on ``num_shards`` shards.

        Promises: the result depends only on the arguments' values (not their order);
        tensors above ``block_size_bytes`` are split; shard loads differ by at most one
        block size. Raises ValueError for num_shards < 1, a block size below one
        element, or duplicate parameter names.
        """
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards: must be an integer >= 1 (got {num_shards!r})")
        params = list(params)
        for spec in params:
            if not isinstance(spec, ParamSpec):
                raise ValueError(f"params: expected ParamSpec items (got {type(spec).__name__})")
        largest_item = max((p.itemsize for p in params), default=1)
        if (isinstance(block_size_bytes, bool) or not isinstance(block_size_bytes, int)
                or block_size_bytes < largest_item):
            raise ValueError(f"block_size_bytes: must be an integer >= {largest_item} (one element) "
                             f"(got {block_size_bytes!r})")
        _refuse_duplicate_names(params)

        pieces = []  # (nbytes, key, param, start, stop), in a value-only canonical order
        for spec in sorted(params, key=lambda p: p.name):
            for key, start, stop in _cut(spec, block_size_bytes):
                pieces.append(((stop - start) * spec.itemsize, key, spec.name, start, stop))
        pieces.sort(key=lambda piece: (-piece[0], piece[1]))

        loads = [0] * num_shards
        blocks = []
        for nbytes, key, param, start, stop in pieces:
            shard = min(range(num_shards), key=lambda s: (loads[s], s))
            loads[shard] += nbytes
            blocks.append(Block(key=key, param=param, shard=shard, start=start, stop=stop))
        return cls(params, blocks, num_shards, block_size_bytes)

    # -- queries ------------------------------------------------------------------------

    def blocks_for_shard(self, shard: int) -> list[Block]:
        """The blocks ``shard`` owns, in (parameter name, start) order."""
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard: must be an integer in [0, {self.num_shards}) (got {shard!r})")
        return [b for b in self.blocks if b.shard == shard]

    def blocks_of(self, param: str) -> list[Block]:
        """The blocks of ``param`` in element order (one block when it is not split)."""
        self._spec(param)
        return list(self._by_param[param])

    def block(self, key: str) -> Block:
        """The block stored under ``key`` (a parameter name or ``"<param>#<i>"``)."""
        try:
            return self._by_key[key]
        except KeyError:
            raise ValueError(f"unknown block key {key!r}") from None

    def shard_bytes(self) -> list[int]:
        """Bytes each shard holds, indexed by shard."""
        loads = [0] * self.num_shards
        for block in self.blocks:
            loads[block.shard] += block.numel * self.params[block.param].itemsize
        return loads

    # -- moving tensors in and out of blocks --------------------------------------------

    def split(self, param: str, flat: np.ndarray) -> dict[str, np.ndarray]:
        """``param``'s values cut into its blocks: key -> 1-D array.

        ``flat`` may have the parameter's shape or be flat already; the parts are views
        of it when it is contiguous, copies otherwise.
        """
        spec = self._spec(param)
        values = np.asarray(flat)
        if values.size != spec.numel:
            raise ValueError(f"split {param!r}: got {values.size} elements, the parameter has "
                             f"{spec.numel} (shape {spec.shape})")
        values = values.reshape(-1)
        return {b.key: values[b.start:b.stop] for b in self._by_param[param]}

    def join(self, param: str, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        """Reassemble ``param`` from its blocks (as `split` returns them), in its shape."""
        spec = self._spec(param)
        blocks = self._by_param[param]
        expected = [b.key for b in blocks]
        if set(parts) != set(expected):
            missing = sorted(set(expected) - set(parts))
            extra = sorted(set(parts) - set(expected))
            raise ValueError(f"join {param!r}: missing blocks {missing}, unexpected {extra}")
        pieces = []
        for block in blocks:
            part = np.asarray(parts[block.key]).reshape(-1)
            if part.size != block.numel:
                raise ValueError(f"join {param!r}: block {block.key!r} has {part.size} elements, "
                                 f"expected {block.numel}")
            pieces.append(part)
        return np.concatenate(pieces).reshape(spec.shape)

    # -- serialisation ------------------------------------------------------------------

    def to_json(self) -> str:
        """Canonical JSON: the same plan gives the same bytes on every machine."""
        doc = {
            "version": PLAN_FORMAT_VERSION,
            "num_shards": self.num_shards,
            "block_size_bytes": self.block_size_bytes,
            "params": [[p.name, list(p.shape), p.dtype] for p in self.params.values()],
            "blocks": [[b.key, b.param, b.shard, b.start, b.stop] for b in self.blocks],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> ShardingPlan:
        """The plan `to_json` wrote; raises ValueError for malformed or inconsistent input."""
        try:
            doc = json.loads(s)
            version = doc["version"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"sharding plan JSON: malformed ({type(exc).__name__}: {exc})") from None
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"sharding plan JSON: version {version!r} is not supported "
                             f"(this build reads version {PLAN_FORMAT_VERSION})")
        try:
            params = [ParamSpec(name, tuple(shape), dtype) for name, shape, dtype in doc["params"]]
            blocks = [Block(str(key), str(param), int(shard), int(start), int(stop))
                      for key, param, shard, start, stop in doc["blocks"]]
            num_shards, block_size = int(doc["num_shards"]), int(doc["block_size_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"sharding plan JSON: malformed ({type(exc).__name__}: {exc})") from None
        return cls(params, blocks, num_shards, block_size)

    def digest(self) -> str:
        """sha256 (hex) of `to_json`, for workers and shards to check they agree."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardingPlan) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        return (f"ShardingPlan(params={len(self.params)}, blocks={len(self.blocks)}, "
                f"num_shards={self.num_shards}, shard_bytes={self.shard_bytes()})")

    # -- helpers ------------------------------------------------------------------------

    def _spec(self, param: str) -> ParamSpec:
        try:
            return self.params[param]
        except KeyError:
            raise ValueError(f"unknown parameter {param!r} (the plan has {len(self.params)})") from None

    def _check_consistent(self) -> None:
        """Every parameter's blocks tile [0, numel) in order; keys unique; shards in range."""
        if self.num_shards < 1:
            raise ValueError(f"sharding plan: num_shards must be >= 1 (got {self.num_shards})")
        keys = Counter(b.key for b in self.blocks)
        duplicates = sorted(k for k, n in keys.items() if n > 1)
        if duplicates:
            raise ValueError(f"sharding plan: duplicate block keys {duplicates}")
        covered: dict[str, int] = {name: 0 for name in self.params}
        keys_of: dict[str, list[str]] = {name: [] for name in self.params}
        for block in self.blocks:
            if block.param not in self.params:
                raise ValueError(f"sharding plan: block {block.key!r} names unknown parameter {block.param!r}")
            if not 0 <= block.shard < self.num_shards:
                raise ValueError(f"sharding plan: block {block.key!r} is on shard {block.shard}, "
                                 f"outside [0, {self.num_shards})")
            if block.start != covered[block.param] or block.stop < block.start:
                raise ValueError(f"sharding plan: block {block.key!r} covers [{block.start}, {block.stop}) "
                                 f"but the next range of {block.param!r} starts at {covered[block.param]}")
            covered[block.param] = block.stop
            keys_of[block.param].append(block.key)
        for name, spec in self.params.items():
            keys_in_order = keys_of[name]
            if not keys_in_order:
                raise ValueError(f"sharding plan: parameter {name!r} has no blocks")
            expected = [name] if len(keys_in_order) == 1 else [
                f"{name}{BLOCK_SEPARATOR}{i}" for i in range(len(keys_in_order))]
            if keys_in_order != expected:
                raise ValueError(f"sharding plan: blocks of {name!r} are keyed {keys_in_order}, "
                                 f"expected {expected}")
            if covered[name] != spec.numel:
                raise ValueError(f"sharding plan: blocks of {name!r} cover {covered[name]} of "
                                 f"{spec.numel} elements")
