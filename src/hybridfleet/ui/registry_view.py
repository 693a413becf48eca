"""The UI's view of the model registry, behind a small interface.

`RegistrySource` is all the UI needs: models, their versions and their aliases. When
`hybridfleet.registry` is installed, `registry_source` adapts its `Registry`; without
it the UI leaves the models page out.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol


class RegistrySource(Protocol):
    """What the models page reads."""

    def models(self) -> list[dict[str, Any]]:
        """``[{"name", "description", ...}]``"""

    def versions(self, name: str) -> list[dict[str, Any]]:
        """``[{"version", "created", "metrics", "tags", ...}]`` of one model."""

    def aliases(self, name: str) -> list[dict[str, Any]]:
        """``[{"alias", "version", ...}]``: the history of a model's aliases, newest last."""


class _RegistryAdapter:
    """`RegistrySource` over `hybridfleet.registry.Registry` (read-only calls only)."""

    def __init__(self, registry: Any):
        self._registry = registry

    def models(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._registry.list_models()]

    def versions(self, name: str) -> list[dict[str, Any]]:
        return [v.to_dict() if hasattr(v, "to_dict") else dict(v) for v in self._registry.list_versions(name)]

    def aliases(self, name: str) -> list[dict[str, Any]]:
        return [dict(h) for h in self._registry.history(name)]


def registry_available() -> bool:
    """Whether the registry package is installed."""
    return importlib.util.find_spec("hybridfleet.registry") is not None


def registry_source(db_url: str | None) -> RegistrySource | None:
    """The installed registry at ``db_url`` (its default when None), or None without the registry package."""
    if not registry_available():
        return None
    from hybridfleet.registry import Registry

    return _RegistryAdapter(Registry(db_url) if db_url else Registry())
