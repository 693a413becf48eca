"""Talking to a registry: `open_registry` gives a local `Registry` or a `RemoteRegistry` over REST.

`RemoteRegistry` has the same methods as `Registry`; errors come back as the same
exception classes (a 403 is a PermissionDeniedError naming the missing role). A pull
asks the server which version and manifest to read, then reads and verifies the bytes
straight from the artifact store (the client needs access to it, as with MLflow).
"""

from __future__ import annotations

import os
from typing import Any

from hybridfleet.errors import (
    AuthError,
    CheckpointError,
    ConflictError,
    GateFailedError,
    HfleetError,
    PermissionDeniedError,
    RegistryError,
    RegistryNotFoundError,
    SchemaError,
)
from hybridfleet.registry import artifacts
from hybridfleet.registry.auth import check_principal_name
from hybridfleet.registry.refs import check_alias, parse_name
from hybridfleet.registry.service import Registry, VersionInfo
from hybridfleet.store import open_store

URL_ENV = "HFLEET_REGISTRY"
TOKEN_ENV = "HFLEET_REGISTRY_TOKEN"
CA_ENV = "HFLEET_REGISTRY_CA"  # CA certificate (PEM) the client verifies an https:// server with
CLIENT_CERT_ENV = "HFLEET_REGISTRY_CLIENT_CERT"  # client certificate (PEM) for mutual TLS; its key next to it (.key)
_KINDS = {cls.kind: cls for cls in (AuthError, PermissionDeniedError, RegistryNotFoundError, ConflictError,
                                   CheckpointError, RegistryError, SchemaError)}  # fmt: skip


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_registry(url: str | None = None, token: str | None = None, store: str | None = None, ca: str | None = None):
    """A registry at ``url`` (``http(s)://`` server, or a database URL/path; default ``$HFLEET_REGISTRY``,
    then the local SQLite registry) acting for ``token`` (default ``$HFLEET_REGISTRY_TOKEN``).

    ``ca`` (default ``$HFLEET_REGISTRY_CA``): the CA certificate an ``https://`` server's
    certificate must chain to (without it: the system's trust store).
    """
    url = url or os.environ.get(URL_ENV) or None
    token = token or os.environ.get(TOKEN_ENV) or None
    if url and url.startswith(("http://", "https://")):
        return RemoteRegistry(url, token, ca=ca or os.environ.get(CA_ENV) or None,
                              client_cert=os.environ.get(CLIENT_CERT_ENV) or None)  # fmt: skip
    return Registry(url, token=token, store=store)


class RemoteRegistry:
    """The registry's operations over its REST API."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 60.0, ca: str | None = None,
                 client_cert: str | None = None):  # fmt: skip
        """``ca``: CA certificate file (PEM) the server's certificate must chain to (default: the
        system's trust store); ``client_cert``: a client certificate (PEM, its key in the same
        path with ``.key``) for a server that asks for mutual TLS. A token is never sent over
        plain ``http://`` to another machine."""
        import ssl
        from urllib.parse import urlsplit

        if not token:
            raise AuthError(f"a registry server needs a token: --token or ${TOKEN_ENV}")
        try:
            import httpx
        except ImportError as err:
            raise RegistryError("talking to a registry server needs httpx: pip install 'hybridfleet[registry]'") from err
        parts = urlsplit(url)
        if parts.scheme == "http" and not is_loopback(parts.hostname or ""):
            raise RegistryError(f"refusing to send a registry token in clear to {url}: use https:// "
                                f"(the server serves TLS with `hfleet registry serve --certs DIR`)")
        verify: Any = True
        if parts.scheme == "https":
            try:
                verify = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
                if client_cert:
                    key = client_cert[: -len(".pem")] + ".key" if client_cert.endswith(".pem") else client_cert + ".key"
                    verify.load_cert_chain(client_cert, key)
            except (OSError, ssl.SSLError) as err:
                raise AuthError(f"registry TLS files unusable (CA {ca}, client certificate {client_cert}): {err}") from err
        self._http_error = (httpx.HTTPError, httpx.InvalidURL)
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url + "/api/v1", timeout=timeout_s, verify=verify,
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        self._store_url: str | None = None

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except self._http_error as err:
            if not isinstance(err, self._http_error[0]):
                raise RegistryError(f"registry request {method} {path!r} is not a valid URL: {err}") from err
            raise RegistryError(f"registry server {self.url} did not answer: {err}") from err
        if response.status_code < 400:
            return response.json()
        try:
            body = response.json()
        except ValueError:
            raise RegistryError(f"registry server {self.url}: HTTP {response.status_code} {response.text[:200]}") from None
        detail = body.get("detail", body)
        if body.get("error") == "gate":
            raise GateFailedError(str(detail), body.get("reasons"))
        raise _KINDS.get(body.get("error"), HfleetError)(str(detail))

    @staticmethod
    def _model_path(name: str) -> str:
        namespace, short = parse_name(name)
        return f"/models/{namespace}/{short}"

    @property
    def store_url(self) -> str:
        if self._store_url is None:
            self._store_url = self._call("GET", "/info")["store"]
        return self._store_url

    def create_model(self, name: str, description: str = "") -> dict:
        return self._call("POST", "/models", json={"name": name, "description": description})

    def register(self, name: str, checkpoint_url: str, step: int | None = None, description: str = "",
                 tags: dict | None = None, metrics: dict | None = None, lineage: dict | None = None) -> VersionInfo:  # fmt: skip
        body = {"checkpoint_url": checkpoint_url, "step": step, "description": description, "tags": tags or {},
                "metrics": metrics or {}, "lineage": lineage or {}}  # fmt: skip
        return VersionInfo(**self._call("POST", f"{self._model_path(name)}/versions", json=body))

    def register_run(self, name: str, model_root: str, which: str = "final", description: str = "",
                     tags: dict | None = None, metrics: dict | None = None) -> VersionInfo:  # fmt: skip
        body = {"checkpoint_url": model_root, "run_model": True, "which": which, "description": description,
                "tags": tags or {}, "metrics": metrics or {}}  # fmt: skip
        return VersionInfo(**self._call("POST", f"{self._model_path(name)}/versions", json=body))

    def get_version(self, ref: str) -> VersionInfo:
        return VersionInfo(**self._call("GET", "/version", params={"ref": ref}))

    def resolve_version(self, ref: str, key: str | None = None) -> VersionInfo:
        return VersionInfo(**self._call("GET", "/version", params={"ref": ref, **({"key": key} if key else {})}))

    def list_versions(self, name: str) -> list[VersionInfo]:
        return [VersionInfo(**v) for v in self._call("GET", f"{self._model_path(name)}/versions")]

    def list_models(self, namespace: str | None = None) -> list[dict]:
        return self._call("GET", "/models", params={"namespace": namespace} if namespace else {})

    def search(self, tags: dict[str, str], namespace: str | None = None, limit: int = 100) -> list[VersionInfo]:
        params: dict[str, Any] = {"tag": [f"{k}={v}" for k, v in tags.items()]}
        if namespace:
            params["namespace"] = namespace
        return [VersionInfo(**v) for v in self._call("GET", "/search", params=params)][:limit]

    def set_tags(self, ref: str, tags: dict[str, str]) -> VersionInfo:
        return VersionInfo(**self._call("POST", "/tags", json={"ref": ref, "tags": tags}))

    def resolve(self, ref: str, key: str | None = None) -> dict:
        return self._call("GET", "/resolve", params={"ref": ref, **({"key": key} if key else {})})

    def move_alias(self, name: str, alias: str, version: int, reason: str = "", expect_revision: int | None = None) -> dict:
        body = {"version": version, "reason": reason, "expect_revision": expect_revision}
        return self._call("PUT", f"{self._model_path(name)}/aliases/{check_alias(alias)}", json=body)

    def protect_alias(self, name: str, alias: str, protected: bool = True) -> dict:
        return self._call("POST", f"{self._model_path(name)}/aliases/{check_alias(alias)}/protect", params={"protected": protected})

    def rollout(self, name: str, alias: str, canary: int | None = None, weight: float | None = None,
                promote: bool = False, rollback: bool = False, reason: str = "") -> dict:  # fmt: skip
        body = {"canary": canary, "weight": weight, "promote": promote, "rollback": rollback, "reason": reason}
        return self._call("POST", f"{self._model_path(name)}/aliases/{check_alias(alias)}/rollout", json=body)

    def history(self, name: str, alias: str | None = None) -> list[dict]:
        return self._call("GET", f"{self._model_path(name)}/history", params={"alias": alias} if alias else {})

    def promote(self, name: str, version: int | str, alias: str, require: list[str], no_regression_vs: str | None = None,
                tolerance: float = 0.0, reason: str = "", trust_claimed: bool = False,
                measurement: Any = None) -> dict:  # fmt: skip
        if measurement is not None and hasattr(measurement, "to_dict"):
            measurement = measurement.to_dict()
        body = {"version": version, "alias": alias, "require": require, "no_regression_vs": no_regression_vs,
                "tolerance": tolerance, "reason": reason, "trust_claimed": trust_claimed, "measurement": measurement}  # fmt: skip
        return self._call("POST", f"{self._model_path(name)}/promote", json=body)

    def pull(self, ref: str, framework: str | None, fmt: str = "safetensors", out_dir: str | None = None,
             key: str | None = None) -> dict:  # fmt: skip
        info = self.resolve_version(ref, key)
        manifest, state, groups = artifacts.read_version(open_store(self.store_url), info.manifest_path, info.manifest_sha256)
        out = out_dir or f"{info.name.split('/')[-1]}-v{info.version}"
        framework = artifacts.pull_framework(info, framework)
        path = artifacts.export_weights(manifest, state, groups, framework, fmt, out)
        return {"name": info.name, "version": info.version, "path": str(path), "framework": framework, "format": fmt}

    def add_principal(self, name: str, kind: str = "user", ttl: str | None = None) -> str:
        return self._call("POST", "/principals", json={"name": name, "kind": kind, "ttl": ttl})["token"]

    def rotate_token(self, name: str, ttl: str | None = None, keep_old: bool = False) -> str:
        check_principal_name(name)  # a path segment: checked before it becomes a URL
        return self._call("POST", f"/principals/{name}/token", json={"ttl": ttl, "keep_old": keep_old})["token"]

    def remove_principal(self, name: str) -> None:
        check_principal_name(name)
        self._call("DELETE", f"/principals/{name}")

    def grant(self, principal: str, role: str, scope: str) -> dict:
        return self._call("POST", "/grants", json={"principal": principal, "role": role, "scope": scope})

    def whoami(self) -> dict:
        return self._call("GET", "/whoami")
