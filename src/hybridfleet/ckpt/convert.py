"""Cross-framework conversion of a whole checkpoint (torch <-> paddle)."""

from __future__ import annotations

from typing import Any

from hybridfleet.ckpt.checkpoint import CheckpointInfo, read_newest_valid, write_checkpoint
from hybridfleet.ckpt.snapshot import Snapshot
from hybridfleet.errors import CheckpointError
from hybridfleet.frameworks.layout import FRAMEWORK_NAMES, convert_state
from hybridfleet.obs.log import get_logger
from hybridfleet.store import open_store

log = get_logger("ckpt.convert")


def convert_checkpoint(
    src_url: str, dst_url: str, to: str, step: int | None = None,
    src_options: dict[str, Any] | None = None, dst_options: dict[str, Any] | None = None,
) -> CheckpointInfo:  # fmt: skip
    """Write the newest valid checkpoint of ``src_url`` (or ``step``) to ``dst_url`` laid out for ``to``.

    Model weights are converted with the layer layouts recorded at save time (see
    `hybridfleet.frameworks.layout`); the framework RNG and the optimizer state do not
    carry over between frameworks and are dropped (logged); python/numpy RNG, user
    state and metrics are kept. Raises CheckpointError for raw-tensor checkpoints and
    for a tensor of unknown layout (naming it), before anything is written.
    """
    if to not in FRAMEWORK_NAMES:
        raise ValueError(f"--to must be one of {FRAMEWORK_NAMES} (got {to!r})")
    source = open_store(src_url, **(src_options or {}))
    manifest, state, groups = read_newest_valid(source, step)
    if "model" not in groups:
        raise CheckpointError(f"{source.url} step {manifest.step} has no model tensors (raw tensors have no layer layout to convert)")
    src = manifest.framework
    if src not in FRAMEWORK_NAMES:
        raise CheckpointError(f"{source.url} step {manifest.step}: unknown source framework {src!r}")
    weights, kinds = convert_state(groups["model"], state.get("layouts", {}), src, to)
    new_state = dict(state)
    new_state.update(framework=to, framework_version=None, layouts=kinds, converted_from=src)
    new_state["rng"] = {k: v for k, v in (state.get("rng") or {}).items() if k in ("python", "numpy")}
    if "optimizer" in groups or state.get("optimizer_meta"):
        new_state.pop("optimizer_meta", None)
        log.info("optimizer_state_dropped", src=source.url, step=manifest.step, reason=f"{src} optimizer state does not map to {to}")
    snapshot = Snapshot(step=manifest.step, framework=to, groups={"model": weights}, state=new_state, metrics=manifest.metrics)
    return write_checkpoint(open_store(dst_url, **(dst_options or {})), snapshot)
