"""JSON round-trip of optimizer hyper-parameter groups (tuples such as Adam's betas)."""

from __future__ import annotations

from typing import Any


def to_json_group(group: dict[str, Any]) -> dict[str, Any]:
    """A JSON-able copy of one param group; tuples are recorded so they come back as tuples."""
    out: dict[str, Any] = {}
    tuples = []
    for key, value in group.items():
        if isinstance(value, tuple):
            tuples.append(key)
            value = list(value)
        if hasattr(value, "item") and not isinstance(value, (list, dict)):
            value = value.item()
        out[key] = value
    if tuples:
        out["__tuples__"] = tuples
    return out


def from_json_group(group: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `to_json_group`."""
    out = {k: v for k, v in group.items() if k != "__tuples__"}
    for key in group.get("__tuples__", []):
        out[key] = tuple(out[key])
    return out
