"""`hfleet serve`: an Open Inference Protocol v2 REST server (FastAPI on uvicorn) for one model alias.

Endpoints (per ``shared/schemas/kserve`` and KServe's own Python server):

    GET  /v2/health/live | /v2/health/ready           no token (probes)
    GET  /metrics                                      Prometheus text, no token
    GET  /v2                                           server metadata
    GET  /v2/models/{m}[/versions/{v}][/ready]         model metadata / readiness
    POST /v2/models/{m}[/versions/{v}]/infer           inference; the response names the version that answered

Every request but probes and metrics carries ``Authorization: Bearer <registry token>``
(`hybridfleet.serve.auth`). Errors are ``{"error": message}``: 400 bad input, 401 no or
bad token, 403 no reader role, 404 unknown model or version; a failing runtime is counted
and answered 503, never with a traceback. A request is routed by `hybridfleet.serve.routing`;
its routing key is the ``X-Routing-Key`` header or the ``routing_key`` request parameter.
The infer routes are served by `hybridfleet.serve.infer` ahead of FastAPI (`OipApp`); FastAPI
answers the rest.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hybridfleet import __version__
from hybridfleet.errors import AuthError, PermissionDeniedError
from hybridfleet.serve.auth import TokenGate
from hybridfleet.serve.infer import InferEndpoint, infer_target, not_served
from hybridfleet.serve.routing import Rollout, RolloutState
from hybridfleet.serve.stats import RequestStats

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServeMetrics:
    """The server's Prometheus series, in a registry of its own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestStats(LATENCY_BUCKETS_S)  # requests by version and code, latency by version
        self.registry.register(self.requests)
        self.errors = Counter("hybridfleet_serve_errors_total", "Failed inference requests, by version and kind",
                              ["model", "version", "kind"], registry=self.registry)  # fmt: skip
        self.refresh_errors = Counter("hybridfleet_serve_rollout_refresh_errors_total",
                                      "Alias refreshes that failed (the previous routing stayed)", ["model"],
                                      registry=self.registry)  # fmt: skip
        self.canary_weight = Gauge("hybridfleet_serve_canary_weight_percent", "The rollout's canary weight in use",
                                   ["model"], registry=self.registry)  # fmt: skip


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(rollout: Rollout, gate: TokenGate | None, metrics: ServeMetrics | None = None) -> OipApp:
    """The OIP v2 app serving ``rollout``'s model; ``gate`` None only when auth was explicitly turned off."""
    metrics = metrics or ServeMetrics()
    app = FastAPI(title="hfleet serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    name = rollout.model_name

    def authorize(request: Request) -> JSONResponse | None:
        if gate is None:
            return None
        try:
            gate.check(request.headers.get("authorization"))
        except AuthError as err:
            return _error(401, str(err))
        except PermissionDeniedError as err:
            return _error(403, str(err))
        return None

    def known(model: str, version: str | None, state: RolloutState) -> JSONResponse | None:
        """404 unless ``model`` (and ``version``) is served in ``state`` (one state per request: a
        rollout change between the check and the use cannot make the version vanish)."""
        missing = not_served(name, model, version, state)
        return _error(404, missing) if missing else None

    @app.get("/v2/health/live")
    def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    def ready() -> dict[str, bool]:
        return {"ready": True}  # the server starts only once its first rollout state is loaded

    @app.get("/metrics")
    def prometheus() -> Response:
        metrics.canary_weight.labels(name).set(rollout.state.weight if rollout.state.canary is not None else 0.0)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v2")
    def server_metadata(request: Request) -> Any:
        return authorize(request) or {"name": "hybridfleet", "version": __version__, "extensions": ["binary_tensor_data"]}

    def model_metadata(request: Request, model: str, version: str | None) -> Any:
        state = rollout.state
        refused = authorize(request) or known(model, version, state)
        if refused:
            return refused
        runtime = state.runtimes[int(version) if version else state.stable]
        return {"name": name, "versions": [str(v) for v in sorted(state.runtimes)], "platform": runtime.platform,
                "inputs": [t.to_dict() for t in runtime.inputs], "outputs": [t.to_dict() for t in runtime.outputs]}  # fmt: skip

    def model_ready(request: Request, model: str, version: str | None) -> Any:
        refused = authorize(request) or known(model, version, rollout.state)
        return refused or {"name": model, "ready": True}

    @app.get("/v2/models/{model}")
    def metadata_any(request: Request, model: str) -> Any:
        return model_metadata(request, model, None)

    @app.get("/v2/models/{model}/versions/{version}")
    def metadata_version(request: Request, model: str, version: str) -> Any:
        return model_metadata(request, model, version)

    @app.get("/v2/models/{model}/ready")
    def ready_any(request: Request, model: str) -> Any:
        return model_ready(request, model, None)

    @app.get("/v2/models/{model}/versions/{version}/ready")
    def ready_version(request: Request, model: str, version: str) -> Any:
        return model_ready(request, model, version)

    return OipApp(app, InferEndpoint(rollout, gate, metrics))


class OipApp:
    """The served ASGI app: infer requests go straight to `InferEndpoint`, everything else to FastAPI."""

    def __init__(self, app: FastAPI, endpoint: InferEndpoint):
        self.app, self.endpoint = app, endpoint
        self.state = app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        target = infer_target(scope["path"]) if scope["type"] == "http" else None
        if target is None:
            return await self.app(scope, receive, send)
        return await self.endpoint.asgi(scope, receive, send, *target)
