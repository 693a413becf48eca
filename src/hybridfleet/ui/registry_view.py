"""The UI's view of the model registry: opened read-only, read with each viewer's own permissions.

`RegistryAccess` opens an *existing* registry (a SQLite file that exists, a PostgreSQL
database or an ``http(s)://`` registry server) and never creates one. Every page reads
through `RegistryAccess.view`, which acts for one principal's token: a fixed token given
to the UI (``--registry-token``), else the viewer's own from the sign-in cookie. Without
a token there is no view (the UI never acts as the database's owner).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from hybridfleet.errors import AuthError, HfleetError, RegistryError

URL_ENV = "HFLEET_REGISTRY"
TOKEN_ENV = "HFLEET_UI_REGISTRY_TOKEN"  # not the CLI's token: what the UI shows every viewer


class RegistryView(Protocol):
    """What the models pages read, for one principal."""

    def whoami(self) -> dict[str, Any]:
        """``{"name", "grants", ...}`` of the principal."""

    def models(self) -> list[dict[str, Any]]:
        """``[{"name", "description", "latest"}]``: the models the principal may read."""

    def versions(self, name: str) -> list[dict[str, Any]]:
        """Every version of one model (VersionInfo as a dict), oldest first."""

    def history(self, name: str) -> list[dict[str, Any]]:
        """The model's alias history, oldest first."""


class _View:
    """`RegistryView` over a `Registry` or `RemoteRegistry` acting for one token (read-only calls only)."""

    def __init__(self, registry: Any):
        self._registry = registry

    def whoami(self) -> dict[str, Any]:
        return self._registry.whoami()

    def models(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._registry.list_models()]

    def versions(self, name: str) -> list[dict[str, Any]]:
        return [v.to_dict() for v in self._registry.list_versions(name)]

    def history(self, name: str) -> list[dict[str, Any]]:
        return [dict(h) for h in self._registry.history(name)]


class RegistryAccess:
    """An existing registry the UI reads, and the token it reads with (None: each viewer signs in)."""

    def __init__(self, url: str, token: str | None = None):
        self.url = url
        self.token = token or None
        self._local = None
        if not url.startswith(("http://", "https://")):
            from hybridfleet.registry import Registry, db

            normalized = db.normalize_url(url)
            if normalized.startswith("sqlite:"):
                path = normalized[len("sqlite:///"):]
                if normalized == "sqlite:///:memory:" or not Path(path).is_file():
                    raise RegistryError(f"no registry database at {path}: the UI opens existing registries only "
                                        f"(create one with `hfleet registry init`)")
            self._local = Registry(url, create=False)

    @property
    def viewer_signs_in(self) -> bool:
        """True when each viewer brings their own token."""
        return self.token is None

    def view(self, viewer_token: str | None = None) -> RegistryView:
        """The registry as the UI's fixed token (or else ``viewer_token``) may read it; AuthError without one."""
        token = self.token or viewer_token
        if not token:
            raise AuthError("sign in with your registry token to see the models")
        if self._local is not None:
            return _View(self._local.for_token(token))
        from hybridfleet.registry.client import RemoteRegistry

        return _View(RemoteRegistry(self.url, token))


def registry_available() -> bool:
    """Whether the registry package is installed."""
    return importlib.util.find_spec("hybridfleet.registry") is not None


def open_access(url: str | None, token: str | None = None) -> tuple[RegistryAccess | None, str]:
    """(access, why there is none): the registry at ``url`` (default ``$HFLEET_REGISTRY``) read with ``token``
    (default ``$HFLEET_UI_REGISTRY_TOKEN``; None: viewers sign in). Nothing is created; ``None`` with the reason
    when no registry is configured or it cannot be opened."""
    if not registry_available():
        return None, "the registry package is not installed"
    url = url or os.environ.get(URL_ENV) or None
    if not url:
        return None, "no registry configured: start the UI with --registry URL (or set $HFLEET_REGISTRY)"
    try:
        return RegistryAccess(url, token or os.environ.get(TOKEN_ENV) or None), ""
    except (HfleetError, SQLAlchemyError) as err:
        return None, f"no registry configured: {str(err).splitlines()[0]}"
