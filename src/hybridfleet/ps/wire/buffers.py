"""How model buffers (BatchNorm running statistics, counters) travel with the parameters.

Under ``ps.buffers: average`` or ``broadcast`` each buffer is one more tensor of the
sharding plan, named ``buffer:<name>``, holding the buffer's elements and one more: a
sample weight. A worker pushes ``[w * (job - local)..., w]``: how far its forward passes
moved the statistics from the job's values it last pulled, times the samples that moved
them (``w = 0`` adds nothing: the followers of ``broadcast``). The shard's round mean then
holds ``sum(w_i * d_i) / W`` and ``sum(w_i) / W`` (W: the round's contributors) and it sets

    job -= sum(w_i * d_i) / sum(w_i)

which, from a common start, is the sample-weighted mean of every worker's local update
(FedAvg over the state dict), and in ``asp``/``ssp`` adds each worker's own change. A
buffer tensor is never split across shards (its weight is its last element) and always
travels dense (``codec: none``), whatever the job's codec: a top-k running variance is
not a variance.
"""

from __future__ import annotations

import functools

import numpy as np

from hybridfleet.codec import get_codec

PREFIX = "buffer:"
DTYPE = np.dtype("<f4")


def wire_name(name: str) -> str:
    """The plan name of buffer ``name``."""
    return PREFIX + name


def is_buffer(name_or_key: str) -> bool:
    """Whether a plan name (or a block key) is a buffer's."""
    return name_or_key.startswith(PREFIX)


def buffer_name(wire: str) -> str:
    """The buffer's own name for its plan name."""
    return wire[len(PREFIX):]


@functools.cache
def dense_codec():
    """The codec every buffer travels with (uplink and compressed downlink); stateless, shared."""
    return get_codec("none")


def check_buffer_blocks(specs, block_size_bytes: int) -> str | None:
    """Why these plan specs cannot carry buffers (one is larger than one block), or None."""
    for spec in specs:
        if is_buffer(spec.name) and spec.nbytes > block_size_bytes:
            return (f"buffer {buffer_name(spec.name)!r} holds {spec.numel - 1} elements ({spec.nbytes} bytes with its "
                    f"weight), more than one block of ps.block_size_bytes={block_size_bytes}; raise "
                    f"ps.block_size_bytes or set ps.buffers: local")
    return None


def check_update(key: str, update: np.ndarray) -> str | None:
    """Why a pushed buffer update is refused (a negative weight), or None."""
    if update.size < 1 or update[-1] < 0:
        return f"buffer key {key!r}: the sample weight (last element) must be >= 0 (got {update[-1:]})"
    return None


def apply_update(values: np.ndarray, update: np.ndarray) -> None:
    """``values[:-1] -= update[:-1] / update[-1]`` in float64 (nothing when the round's weight is 0)."""
    weight = float(update[-1])
    if weight > 0:
        values[:-1] = (values[:-1].astype(np.float64) - update[:-1].astype(np.float64) / weight).astype(DTYPE)
