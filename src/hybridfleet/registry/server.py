"""`hfleet registry serve`: the registry's operations over REST (FastAPI on uvicorn), token auth.

Every request carries ``Authorization: Bearer <token>``; the token's principal and its
grants decide what it may do. Errors are JSON ``{"error": kind, "detail": message}`` with
401 (no or bad token), 403 (missing permission; the detail names it), 404, 409 (alias
conflict), 422 (gate refused, with ``reasons``), 400 (other bad input). The OpenAPI
document is at ``/openapi.json`` (browsable at ``/docs``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Annotated, Any, Callable

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridfleet.errors import (
    AuthError,
    CheckpointError,
    ConflictError,
    GateFailedError,
    HfleetError,
    PermissionDeniedError,
    RegistryError,
    RegistryNotFoundError,
)
from hybridfleet.registry.auth import parse_bearer
from hybridfleet.registry.client import is_loopback
from hybridfleet.registry.http_limits import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    BodyLimit,
    DeadlineH11Protocol,
)
from hybridfleet.registry.refs import MAX_VERSION
from hybridfleet.registry.service import Registry

log = logging.getLogger("hybridfleet.registry.server")

API = "/api/v1"
STATUS = [(AuthError, 401), (PermissionDeniedError, 403), (RegistryNotFoundError, 404), (ConflictError, 409),
          (GateFailedError, 422), (CheckpointError, 409), (HfleetError, 400)]  # fmt: skip


# Numbers the database stores in an integer column; floats finite. Out-of-range input is a 422
# with the project's error shape, never an overflow in the database driver.
Int32 = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Version = Annotated[int, Field(ge=1, le=MAX_VERSION)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, Field(max_length=4096)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewModel(Body):
    name: Text
    description: Text = ""


class NewVersion(Body):
    checkpoint_url: Text
    step: Int32 | None = None
    description: Text = ""
    tags: dict[str, str] = Field(default_factory=dict)
    metrics: dict[str, Finite] = Field(default_factory=dict)
    lineage: dict[str, Any] = Field(default_factory=dict)
    run_model: bool = Field(False, description="checkpoint_url is a run's model root with MODEL.json")
    which: Text = "final"


class Tags(Body):
    ref: Text
    tags: dict[str, str]


class AliasMove(Body):
    version: Version
    reason: Text = ""
    expect_revision: Int32 | None = None


class Rollout(Body):
    canary: Version | None = None
    weight: Finite | None = None
    promote: bool = False
    rollback: bool = False
    reason: Text = ""


class Promotion(Body):
    version: Version | Text
    alias: Text
    require: list[Text] = Field(default_factory=list, max_length=64)
    no_regression_vs: Text | None = None
    tolerance: Finite = 0.0
    reason: Text = ""
    trust_claimed: bool = Field(False, description="let the gate accept metrics the writer only claimed")
    measurement: dict[str, Any] | None = Field(None, description="what `promote --evaluate` measured, recorded first")


class NewPrincipal(Body):
    name: Text
    kind: Text = "user"
    ttl: Text | None = Field(None, description="token lifetime, e.g. 30d, 12h (default: no expiry)")


class TokenRotation(Body):
    ttl: Text | None = Field(None, description="the new token's lifetime, e.g. 30d (default: no expiry)")
    keep_old: bool = Field(False, description="the current token stays valid until its own expiry")


class Grant(Body):
    principal: Text
    role: Text
    scope: Text


def check_source(url: str, allowed_roots: list[str] | None) -> None:
    """Refuse a local checkpoint outside ``allowed_roots`` (None: any path, for local use), or one with links.

    The path is compared after resolving links, and every entry under it is looked at
    without following any: a symbolic link inside a checkpoint is refused by its name
    alone (its target is never opened, so no error reveals anything about it).
    """
    if allowed_roots is None or url.startswith(("s3://", "gs://", "http://", "https://")):
        return
    from hybridfleet.store import open_store

    try:
        local = open_store(url).url
    except (OSError, ValueError) as err:
        raise RegistryError(f"checkpoint URL {url!r} is not a readable location") from err
    if not any(local == root or local.startswith(root.rstrip("/") + "/") for root in allowed_roots):
        raise RegistryError(f"this server reads local checkpoints only under {', '.join(allowed_roots)}; "
                            f"use an s3:// URL or start it with --allow-path")
    if not local.startswith("file://"):
        return
    root = local[len("file://"):]
    for folder, dirs, files in os.walk(root, followlinks=False):
        for entry in dirs + files:
            if os.path.islink(os.path.join(folder, entry)):
                rel = os.path.relpath(os.path.join(folder, entry), root)
                raise RegistryError(f"checkpoint {url} contains a symbolic link ({rel}); "
                                    f"this server does not follow links: copy the files in instead")


def create_app(registry: Registry, allowed_roots: list[str] | None = None) -> FastAPI:
    """The REST app over ``registry`` (its engine and store; each request acts for its token).

    ``allowed_roots``: the local folders a registration may read checkpoints from (None: any).
    """
    app = FastAPI(title="hybridfleet model registry", version="1", openapi_url="/openapi.json")
    served = registry.with_source_check(lambda url: check_source(url, allowed_roots))

    @app.exception_handler(HfleetError)
    async def _error(_request: Request, err: HfleetError) -> JSONResponse:
        status = next(code for cls, code in STATUS if isinstance(err, cls))
        body: dict[str, Any] = {"error": err.kind, "detail": str(err)}
        if isinstance(err, GateFailedError):
            body["reasons"] = err.reasons
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in err.errors()[:10])
        return JSONResponse({"error": "registry", "detail": f"invalid request: {problems}"}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "registry_not_found" if err.status_code == 404 else "registry"
        return JSONResponse({"error": kind, "detail": str(err.detail)}, status_code=err.status_code,
                            headers=getattr(err, "headers", None))  # fmt: skip

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        # Last resort only: every known bad input has its own 4xx. Logged with the traceback.
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return JSONResponse({"error": "error", "detail": "unexpected internal error (logged by the server)"}, status_code=500)

    def caller(authorization: str | None = Header(None)) -> Registry:
        return served.for_token(parse_bearer(authorization))

    @app.get(f"{API}/info")
    def info(reg: Registry = Depends(caller)) -> dict:
        return {"store": reg.store_url, "whoami": reg.whoami()}

    @app.get(f"{API}/models")
    def list_models(namespace: str | None = None, reg: Registry = Depends(caller)) -> list:
        return reg.list_models(namespace)

    @app.post(f"{API}/models", status_code=201)
    def create_model(body: NewModel, reg: Registry = Depends(caller)) -> dict:
        return reg.create_model(body.name, body.description)

    @app.get(f"{API}/models/{{namespace}}/{{name}}/versions")
    def list_versions(namespace: str, name: str, reg: Registry = Depends(caller)) -> list:
        return [v.to_dict() for v in reg.list_versions(f"{namespace}/{name}")]

    @app.post(f"{API}/models/{{namespace}}/{{name}}/versions", status_code=201)
    def register(namespace: str, name: str, body: NewVersion, reg: Registry = Depends(caller)) -> dict:
        try:
            json.dumps(body.lineage, allow_nan=False)
        except ValueError as err:
            raise RegistryError(f"lineage: JSON numbers only, finite ({err})") from err
        if body.run_model:
            return reg.register_run(f"{namespace}/{name}", body.checkpoint_url, body.which, body.description, body.tags,
                                    body.metrics).to_dict()  # fmt: skip
        return reg.register(f"{namespace}/{name}", body.checkpoint_url, body.step, body.description, body.tags,
                            body.metrics, body.lineage).to_dict()  # fmt: skip

    @app.get(f"{API}/version")
    def get_version(ref: str, key: str | None = None, reg: Registry = Depends(caller)) -> dict:
        return reg.resolve_version(ref, key).to_dict()

    @app.get(f"{API}/resolve")
    def resolve(ref: str, key: str | None = None, reg: Registry = Depends(caller)) -> dict:
        return reg.resolve(ref, key)

    @app.get(f"{API}/search")
    def search(tag: list[str] = Query(...), namespace: str | None = None, reg: Registry = Depends(caller)) -> list:
        pairs = {}
        for item in tag:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise RegistryError(f"tag {item!r}: expected KEY=VALUE")
            pairs[key] = value
        return [v.to_dict() for v in reg.search(pairs, namespace)]

    @app.post(f"{API}/tags")
    def set_tags(body: Tags, reg: Registry = Depends(caller)) -> dict:
        return reg.set_tags(body.ref, body.tags).to_dict()

    @app.put(f"{API}/models/{{namespace}}/{{name}}/aliases/{{alias}}")
    def move_alias(namespace: str, name: str, alias: str, body: AliasMove, reg: Registry = Depends(caller)) -> dict:
        return reg.move_alias(f"{namespace}/{name}", alias, body.version, body.reason, body.expect_revision)

    @app.post(f"{API}/models/{{namespace}}/{{name}}/aliases/{{alias}}/protect")
    def protect(namespace: str, name: str, alias: str, protected: bool = True, reg: Registry = Depends(caller)) -> dict:
        return reg.protect_alias(f"{namespace}/{name}", alias, protected)

    @app.post(f"{API}/models/{{namespace}}/{{name}}/aliases/{{alias}}/rollout")
    def rollout(namespace: str, name: str, alias: str, body: Rollout, reg: Registry = Depends(caller)) -> dict:
        return reg.rollout(f"{namespace}/{name}", alias, body.canary, body.weight, body.promote, body.rollback, body.reason)

    @app.get(f"{API}/models/{{namespace}}/{{name}}/history")
    def history(namespace: str, name: str, alias: str | None = None, reg: Registry = Depends(caller)) -> list:
        return reg.history(f"{namespace}/{name}", alias)

    @app.post(f"{API}/models/{{namespace}}/{{name}}/promote")
    def promote(namespace: str, name: str, body: Promotion, reg: Registry = Depends(caller)) -> dict:
        return reg.promote(f"{namespace}/{name}", body.version, body.alias, body.require, body.no_regression_vs,
                           body.tolerance, body.reason, body.trust_claimed, body.measurement)  # fmt: skip

    @app.post(f"{API}/principals", status_code=201)
    def add_principal(body: NewPrincipal, reg: Registry = Depends(caller)) -> dict:
        return {"name": body.name, "token": reg.add_principal(body.name, body.kind, ttl=body.ttl)}

    @app.post(f"{API}/principals/{{name}}/token")
    def rotate_token(name: str, body: TokenRotation, reg: Registry = Depends(caller)) -> dict:
        return {"name": name, "token": reg.rotate_token(name, body.ttl, body.keep_old)}

    @app.delete(f"{API}/principals/{{name}}")
    def remove_principal(name: str, reg: Registry = Depends(caller)) -> dict:
        reg.remove_principal(name)
        return {"removed": name}

    @app.post(f"{API}/grants")
    def grant(body: Grant, reg: Registry = Depends(caller)) -> dict:
        return reg.grant(body.principal, body.role, body.scope)

    @app.get(f"{API}/whoami")
    def whoami(reg: Registry = Depends(caller)) -> dict:
        return reg.whoami()

    return app


def uvicorn_config(app: Any, host: str, port: int, certs: str | None = None, client_ca: str | None = None,
                   max_body_bytes: int = MAX_BODY_BYTES) -> Any:  # fmt: skip
    """The uvicorn configuration the registry serves with: TLS from a PKI directory, limits, deadlines.

    ``certs``: a directory made by `hfleet certs init` (its server.pem/server.key are served);
    ``client_ca``: a CA certificate file; clients must then show a certificate it signed
    (mutual TLS). A non-loopback ``host`` without ``certs`` is a UsageError: bearer tokens
    would cross the network in clear.
    """
    import ssl

    import uvicorn

    from hybridfleet.errors import UsageError

    if not certs and not is_loopback(host):
        raise UsageError(f"refusing to serve the registry on {host} without TLS: bearer tokens would travel in clear",
                         hint="pass --certs DIR (make one with `hfleet certs init DIR --host NAME`), "
                              "or bind 127.0.0.1 behind a TLS-terminating proxy")  # fmt: skip
    if client_ca and not certs:
        raise UsageError("--client-ca needs --certs: mutual TLS is TLS first")
    tls: dict[str, Any] = {}
    if certs:
        from hybridfleet.security.certs import load_pki

        pki = load_pki(certs)
        tls = {"ssl_certfile": str(pki.server_cert), "ssl_keyfile": str(pki.server_key)}
        if client_ca:
            if not os.path.isfile(client_ca):
                raise UsageError(f"--client-ca {client_ca}: no such file (a CA certificate in PEM)")
            tls.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    limited = BodyLimit(app, max_body_bytes=max_body_bytes, body_timeout_s=BODY_TIMEOUT_S)
    return uvicorn.Config(limited, host=host, port=port, log_level="warning", http=DeadlineH11Protocol,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=5,
                          limit_concurrency=256, **tls)  # fmt: skip


def serve(db_url: str | None, host: str = "127.0.0.1", port: int = 8080, store: str | None = None,
          allow_paths: list[str] | None = None, certs: str | None = None, client_ca: str | None = None,
          announce: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Serve the registry on ``db_url`` until interrupted; local checkpoints are read only under
    the artifact store and ``allow_paths``; TLS with ``certs`` (see `uvicorn_config`).
    ``announce(url)`` is called once the port is bound (a port in use is a `PortInUseError`)."""
    import uvicorn

    from hybridfleet.launch.preflight import listen, url_of
    from hybridfleet.store import open_store

    if not certs and not is_loopback(host):
        uvicorn_config(None, host, port)  # raises the UsageError before the database is touched
    sock = listen(host, port, "the registry")
    try:
        registry = Registry(db_url, store=store)
        roots = [registry.store_url] + [open_store(p).url for p in allow_paths or []]
        config = uvicorn_config(create_app(registry, roots), host, port, certs, client_ca)
        if announce is not None:
            announce(url_of(sock, "https" if certs else "http"))
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
