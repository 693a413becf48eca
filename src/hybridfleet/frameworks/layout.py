"""Cross-framework state-dict conversion between PyTorch and PaddlePaddle.

Equivalent torch and paddle models use the same attribute names, so state-dict
prefixes match; what differs is per layer kind and listed in `TORCH_TO_PADDLE`:
Linear weights are transposed (torch [out, in], paddle [in, out]); BatchNorm
running statistics are renamed (running_mean/running_var vs _mean/_variance) and
torch's num_batches_tracked has no paddle counterpart. Conv, Embedding and the
norm layers share one layout.

A tensor's layer kind is not derivable from its name and shape alone (a Linear and
an Embedding weight are both 2-D), so the source adapter records each tensor's kind
(`Adapter.module_kinds`) when a checkpoint is saved; conversion reads that table. A
tensor of any other layer (LSTM, attention with fused weights, custom layers) has no
entry and conversion fails naming it.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.errors import CheckpointError

# kind -> torch local name -> (paddle local name, transpose 2-D?) ; None = no paddle counterpart
TORCH_TO_PADDLE: dict[str, dict[str, tuple[str, bool] | None]] = {
    "linear": {"weight": ("weight", True), "bias": ("bias", False)},
    "conv": {"weight": ("weight", False), "bias": ("bias", False)},
    "embedding": {"weight": ("weight", False)},
    "layernorm": {"weight": ("weight", False), "bias": ("bias", False)},
    "groupnorm": {"weight": ("weight", False), "bias": ("bias", False)},
    "batchnorm": {
        "weight": ("weight", False),
        "bias": ("bias", False),
        "running_mean": ("_mean", False),
        "running_var": ("_variance", False),
        "num_batches_tracked": None,
    },
}

FRAMEWORK_NAMES = ("torch", "paddle")


def _split(name: str) -> tuple[str, str]:
    prefix, _, local = name.rpartition(".")
    return prefix, local


def _table(src: str, dst: str) -> dict[str, dict[str, tuple[str, bool] | None]]:
    if src == "torch" and dst == "paddle":
        return TORCH_TO_PADDLE
    if src == "paddle" and dst == "torch":
        return {
            kind: {v[0]: (k, v[1]) for k, v in names.items() if v is not None}
            for kind, names in TORCH_TO_PADDLE.items()
        }
    raise ValueError(f"cannot convert from {src!r} to {dst!r}; frameworks are {FRAMEWORK_NAMES}")


def _target(name: str, kind: str | None, table: dict, src: str, dst: str) -> tuple[str, bool] | None:
    """(name in ``dst``, transpose 2-D?) of ``src``'s tensor ``name``; None when ``dst`` has no counterpart."""
    prefix, local = _split(name)
    if kind not in table or local not in table[kind]:
        raise CheckpointError(
            f"tensor {name!r} has an unknown layout for {src} -> {dst} conversion "
            f"(layer kind {kind or 'unrecorded'}); known kinds: {sorted(table)}"
        )
    target = table[kind][local]
    if target is None:
        return None
    new_local, transpose = target
    return (f"{prefix}.{new_local}" if prefix else new_local), transpose


def param_layout(names: list[str], kinds: dict[str, str], src: str, dst: str) -> dict[str, tuple[str, bool]]:
    """How each trainable tensor of a ``src`` model is named and laid out in ``dst``: name -> (name, transpose).

    Raises CheckpointError naming the first tensor whose layer kind has no known mapping (or no
    counterpart in ``dst``)."""
    if src == dst:
        return {n: (n, False) for n in names}
    table = _table(src, dst)
    out = {}
    for name in sorted(names):
        target = _target(name, kinds.get(name), table, src, dst)
        if target is None:
            raise CheckpointError(f"tensor {name!r} has no {dst} counterpart")
        out[name] = target
    return out


def convert_state(
    tensors: dict[str, np.ndarray], kinds: dict[str, str], src: str, dst: str
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Model tensors of framework ``src`` laid out for framework ``dst``, with their new kinds.

    ``kinds`` maps tensor name -> layer kind as recorded at save time. Raises
    CheckpointError naming the first tensor whose layout is unknown.
    """
    if src == dst:
        return dict(tensors), dict(kinds)
    table = _table(src, dst)
    out: dict[str, np.ndarray] = {}
    out_kinds: dict[str, str] = {}
    batchnorm_prefixes = set()
    for name in sorted(tensors):
        kind = kinds.get(name)
        prefix, _ = _split(name)
        target = _target(name, kind, table, src, dst)
        if target is None:
            continue
        new_name, transpose = target
        arr = tensors[name]
        if transpose:
            if arr.ndim != 2:
                raise CheckpointError(f"tensor {name!r}: a {kind} weight must be 2-D (got shape {list(arr.shape)})")
            arr = np.ascontiguousarray(arr.T)
        out[new_name] = arr
        out_kinds[new_name] = kind
        if kind == "batchnorm":
            batchnorm_prefixes.add(prefix)
    if dst == "torch":
        for prefix in batchnorm_prefixes:
            name = f"{prefix}.num_batches_tracked" if prefix else "num_batches_tracked"
            out[name] = np.zeros((), dtype=np.int64)
            out_kinds[name] = "batchnorm"
    return out, out_kinds
