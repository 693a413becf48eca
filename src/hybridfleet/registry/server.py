"""`hfleet registry serve`: the registry's operations over REST (FastAPI on uvicorn), token auth.

Every request carries ``Authorization: Bearer <token>``; the token's principal and its
grants decide what it may do. Errors are JSON ``{"error": kind, "detail": message}`` with
401 (no or bad token), 403 (missing permission; the detail names it), 404, 409 (alias
conflict), 422 (gate refused, with ``reasons``), 400 (other bad input). The OpenAPI
document is at ``/openapi.json`` (browsable at ``/docs``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

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
from hybridfleet.registry.service import Registry

API = "/api/v1"
STATUS = [(AuthError, 401), (PermissionDeniedError, 403), (RegistryNotFoundError, 404), (ConflictError, 409),
          (GateFailedError, 422), (CheckpointError, 409), (HfleetError, 400)]  # fmt: skip


class NewModel(BaseModel):
    name: str
    description: str = ""


class NewVersion(BaseModel):
    checkpoint_url: str
    step: int | None = None
    description: str = ""
    tags: dict[str, str] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    lineage: dict[str, Any] = Field(default_factory=dict)
    run_model: bool = Field(False, description="checkpoint_url is a run's model root with MODEL.json")
    which: str = "final"


class Tags(BaseModel):
    ref: str
    tags: dict[str, str]


class AliasMove(BaseModel):
    version: int
    reason: str = ""
    expect_revision: int | None = None


class Rollout(BaseModel):
    canary: int | None = None
    weight: float | None = None
    promote: bool = False
    rollback: bool = False
    reason: str = ""


class Promotion(BaseModel):
    version: int | str
    alias: str
    require: list[str] = Field(default_factory=list)
    no_regression_vs: str | None = None
    tolerance: float = 0.0
    reason: str = ""
    trust_claimed: bool = Field(False, description="let the gate accept metrics the writer only claimed")
    measurement: dict[str, Any] | None = Field(None, description="what `promote --evaluate` measured, recorded first")


class NewPrincipal(BaseModel):
    name: str
    kind: str = "user"


class Grant(BaseModel):
    principal: str
    role: str
    scope: str


def _check_source(url: str, allowed_roots: list[str] | None) -> None:
    """Refuse a local checkpoint path outside ``allowed_roots`` (None: any path, for local use)."""
    if allowed_roots is None or url.startswith(("s3://", "gs://", "http://", "https://")):
        return
    from hybridfleet.store import open_store

    local = open_store(url).url
    if not any(local == root or local.startswith(root.rstrip("/") + "/") for root in allowed_roots):
        raise RegistryError(f"this server reads local checkpoints only under {', '.join(allowed_roots)}; "
                            f"use an s3:// URL or start it with --allow-path")


def create_app(registry: Registry, allowed_roots: list[str] | None = None) -> FastAPI:
    """The REST app over ``registry`` (its engine and store; each request acts for its token).

    ``allowed_roots``: the local folders a registration may read checkpoints from (None: any).
    """
    app = FastAPI(title="hybridfleet model registry", version="1", openapi_url="/openapi.json")

    @app.exception_handler(HfleetError)
    async def _error(_request: Request, err: HfleetError) -> JSONResponse:
        status = next(code for cls, code in STATUS if isinstance(err, cls))
        body: dict[str, Any] = {"error": err.kind, "detail": str(err)}
        if isinstance(err, GateFailedError):
            body["reasons"] = err.reasons
        return JSONResponse(body, status_code=status)

    def caller(authorization: str | None = Header(None)) -> Registry:
        return registry.for_token(parse_bearer(authorization))

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
        _check_source(body.checkpoint_url, allowed_roots)
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
        return [v.to_dict() for v in reg.search(dict(t.split("=", 1) for t in tag if "=" in t), namespace)]

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
        return {"name": body.name, "token": reg.add_principal(body.name, body.kind)}

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


def serve(db_url: str | None, host: str = "127.0.0.1", port: int = 8080, store: str | None = None,
          allow_paths: list[str] | None = None) -> None:  # fmt: skip
    """Serve the registry on ``db_url`` until interrupted; local checkpoints are read only under
    the artifact store and ``allow_paths``."""
    import uvicorn

    from hybridfleet.store import open_store

    registry = Registry(db_url, store=store)
    roots = [registry.store_url] + [open_store(p).url for p in allow_paths or []]
    app = create_app(registry, roots)
    uvicorn.run(app, host=host, port=port, log_level="warning")
