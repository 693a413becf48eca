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
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route

from hybridfleet import __version__
from hybridfleet.errors import AuthError, PermissionDeniedError
from hybridfleet.serve.auth import TokenGate
from hybridfleet.serve.protocol import HEADER_LENGTH, InferRequestError, encode_infer, parse_infer
from hybridfleet.serve.routing import Rollout, RolloutState

ROUTING_HEADER = "x-routing-key"
ROUTING_PARAMETER = "routing_key"
MAX_BODY_BYTES = 64 * 1024 * 1024
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServeMetrics:
    """The server's Prometheus series, in a registry of its own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hybridfleet_serve_requests_total", "Inference requests answered, by version and HTTP code",
                                ["model", "version", "code"], registry=self.registry)  # fmt: skip
        self.latency = Histogram("hybridfleet_serve_request_duration_seconds", "Inference request time in the server",
                                 ["model", "version"], buckets=LATENCY_BUCKETS_S, registry=self.registry)  # fmt: skip
        self.errors = Counter("hybridfleet_serve_errors_total", "Failed inference requests, by version and kind",
                              ["model", "version", "kind"], registry=self.registry)  # fmt: skip
        self.refresh_errors = Counter("hybridfleet_serve_rollout_refresh_errors_total",
                                      "Alias refreshes that failed (the previous routing stayed)", ["model"],
                                      registry=self.registry)  # fmt: skip
        self.canary_weight = Gauge("hybridfleet_serve_canary_weight_percent", "The rollout's canary weight in use",
                                   ["model"], registry=self.registry)  # fmt: skip


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(rollout: Rollout, gate: TokenGate | None, metrics: ServeMetrics | None = None) -> FastAPI:
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
        if model != name:
            return _error(404, f"model {model!r} is not served here (this server serves {name!r})")
        if version is not None and (not version.isdigit() or int(version) not in state.runtimes):
            return _error(404, f"version {version!r} of {name!r} is not served now (serving {sorted(state.runtimes)})")
        return None

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

    def infer(request: Request, model: str, version: str | None, body: bytes) -> Response:
        started = time.perf_counter()
        state = rollout.state
        refused = authorize(request) or known(model, version, state)
        if refused:
            return refused
        if len(body) > MAX_BODY_BYTES:
            return _error(400, f"request body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}")
        if version is not None:
            number, runtime = int(version), state.runtimes[int(version)]
        else:
            key = request.headers.get(ROUTING_HEADER)
            number, runtime = None, None
        try:
            parsed = parse_infer(body, request.headers.get(HEADER_LENGTH.lower()), (runtime or state.runtimes[state.stable]).inputs,
                                 (runtime or state.runtimes[state.stable]).outputs)  # fmt: skip
        except InferRequestError as err:
            metrics.errors.labels(name, version or "", "bad_request").inc()
            metrics.requests.labels(name, version or "", "400").inc()
            return _error(400, str(err))
        if runtime is None:
            param_key = parsed.parameters.get(ROUTING_PARAMETER)
            number, runtime = rollout.route(key if key is not None else (str(param_key) if param_key is not None else None), state)
        label = str(number)
        try:
            outputs = runtime.run(parsed.inputs)
        except Exception as err:  # noqa: BLE001 - a runtime failure is counted and answered, never a traceback
            metrics.errors.labels(name, label, "runtime").inc()
            metrics.requests.labels(name, label, "503").inc()
            return _error(503, f"version {number} failed to run the request: {type(err).__name__}: {err}")
        payload, header_length = encode_infer(name, number, parsed, outputs, runtime.outputs)
        headers = {HEADER_LENGTH: str(header_length)} if header_length is not None else {}
        metrics.requests.labels(name, label, "200").inc()
        metrics.latency.labels(name, label).observe(time.perf_counter() - started)
        media = "application/octet-stream" if header_length is not None else "application/json"
        return Response(payload, media_type=media, headers=headers)

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

    async def infer_endpoint(request: Request) -> Response:
        params = request.path_params
        return _too_large(request) or await run_in_threadpool(infer, request, params["model"], params.get("version"),
                                                              await request.body())  # fmt: skip

    # The hot path is a plain Starlette route, matched first: FastAPI's per-request dependency
    # solving and telemetry cost more than the rest of a batch-1 request (bench/serve.py).
    app.router.routes[:0] = [Route("/v2/models/{model}/infer", infer_endpoint, methods=["POST"]),
                             Route("/v2/models/{model}/versions/{version}/infer", infer_endpoint, methods=["POST"])]
    return app


def _too_large(request: Request) -> JSONResponse | None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        return _error(400, f"request body of {length} bytes is over the limit of {MAX_BODY_BYTES}")
    return None
