"""A private model registry: namespaces, immutable versions in the checkpoint store, aliases with
history, gray release, promotion gates, permissions; SQLite or PostgreSQL; local or over REST."""

from __future__ import annotations

from hybridfleet.registry.service import Registry, VersionInfo

__all__ = ["Registry", "VersionInfo"]
