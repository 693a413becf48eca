"""The OIP v2 infer endpoint as a plain ASGI handler: the per-request hot path of `hfleet serve`.

``POST /v2/models/{m}/infer`` and ``/v2/models/{m}/versions/{v}/infer`` are matched on the
path before the web framework sees the request: at batch 1 FastAPI's request objects,
routing and a thread-pool hop cost more than parsing, running and encoding together
(bench/serve.py). Every check stays: token (``TokenGate``), model and version, body size
(counted while it is read, before it is kept), the OIP request checks, metrics by version.

A request whose token answer is cached and whose body is small runs on the event loop, as
a minimal uvicorn server runs it; any other (a token to look up in the registry, a large
batch, a runtime that serializes its calls) runs in a worker thread, so neither a registry
round trip nor a long inference holds up the requests behind it.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import Any, Awaitable, Callable

from starlette.concurrency import run_in_threadpool

from hybridfleet.errors import AuthError, PermissionDeniedError
from hybridfleet.serve.auth import TokenGate
from hybridfleet.serve.protocol import HEADER_LENGTH, InferRequestError, TensorCodec
from hybridfleet.serve.routing import Rollout, RolloutState
from hybridfleet.serve.runtime import Runtime

ROUTING_HEADER = "x-routing-key"
ROUTING_PARAMETER = "routing_key"
MAX_BODY_BYTES = 64 * 1024 * 1024
INLINE_MAX_BODY_BYTES = 64 * 1024  # ~16k FP32 values as JSON: well under a millisecond to parse and run
_AUTHORIZATION, _CONTENT_LENGTH = b"authorization", b"content-length"
_ROUTING, _HEADER_LENGTH = ROUTING_HEADER.encode(), HEADER_LENGTH.lower().encode()
_WANTED_HEADERS = {_AUTHORIZATION, _CONTENT_LENGTH, _ROUTING, _HEADER_LENGTH}
_JSON = [(b"content-type", b"application/json")]

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def infer_target(path: str) -> tuple[str, str | None] | None:
    """(model, version or None) when ``path`` is an infer endpoint, else None."""
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[4] == "infer" and parts[3]:
        return parts[3], None
    if len(parts) == 7 and parts[:3] == ["", "v2", "models"] and parts[4] == "versions" and parts[6] == "infer" \
            and parts[3] and parts[5]:
        return parts[3], parts[5]
    return None


def not_served(name: str, model: str, version: str | None, state: Any) -> str | None:
    """Why ``model`` (and ``version``) is not served in rollout ``state`` by the server of ``name``
    (the 404's message), None when it is."""
    if model != name:
        return f"model {model!r} is not served here (this server serves {name!r})"
    if version is not None and (not version.isdigit() or int(version) not in state.runtimes):
        return f"version {version!r} of {name!r} is not served now (serving {sorted(state.runtimes)})"
    return None


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class InferEndpoint:
    """Answers one infer request: (HTTP status, body, extra headers); never raises for a request's content."""

    def __init__(self, rollout: Rollout, gate: TokenGate | None, metrics: Any):
        self.rollout, self.gate, self.metrics = rollout, gate, metrics
        self.name = rollout.model_name
        self._codecs: weakref.WeakKeyDictionary[Runtime, TensorCodec] = weakref.WeakKeyDictionary()
        self._inline: tuple[RolloutState | None, bool] = (None, False)  # (state, whether its runtimes run inline)

    def codec(self, runtime: Runtime) -> TensorCodec:
        """The request codec of ``runtime``'s tensors, built once per loaded model."""
        codec = self._codecs.get(runtime)
        if codec is None:
            codec = self._codecs.setdefault(runtime, TensorCodec(runtime.inputs, runtime.outputs))
        return codec

    def _count(self, version: str, code: str, seconds: float | None = None) -> None:
        self.metrics.requests.answered(self.name, version, code, seconds)

    def __call__(self, headers: dict[bytes, bytes], model: str, version: str | None, body: bytes, started: float,
                 refusal: Exception | None | bool = False) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:  # fmt: skip
        """The answer; ``refusal`` is the token gate's cached answer when the caller has it (False: check now)."""
        state = self.rollout.state  # one read: the version checked is the version used
        if self.gate is not None:
            try:
                if refusal is False:
                    auth = headers.get(_AUTHORIZATION)
                    self.gate.check(auth.decode("latin-1") if auth is not None else None)
                elif refusal is not None:
                    raise refusal
            except AuthError as err:
                return 401, error_body(str(err)), _JSON
            except PermissionDeniedError as err:
                return 403, error_body(str(err)), _JSON
        missing = not_served(self.name, model, version, state)
        if missing:
            return 404, error_body(missing), _JSON
        runtime = state.runtimes[int(version)] if version is not None else None
        declared = runtime or state.runtimes[state.stable]
        length = headers.get(_HEADER_LENGTH)
        try:
            parsed = self.codec(declared).parse(body, length.decode("latin-1") if length is not None else None)
        except InferRequestError as err:
            self.metrics.errors.labels(self.name, version or "", "bad_request").inc()
            self._count(version or "", "400")
            return 400, error_body(str(err)), _JSON
        if runtime is None:
            key = headers.get(_ROUTING)
            param_key = parsed.parameters.get(ROUTING_PARAMETER)
            routing_key = key.decode("latin-1") if key is not None else (str(param_key) if param_key is not None else None)
            number, runtime = self.rollout.route(routing_key, state)
        else:
            number = int(version)
        label = str(number)
        try:
            outputs = runtime.run(parsed.inputs)
        except Exception as err:  # noqa: BLE001 - a runtime failure is counted and answered, never a traceback
            self.metrics.errors.labels(self.name, label, "runtime").inc()
            self._count(label, "503")
            return 503, error_body(f"version {number} failed to run the request: {type(err).__name__}: {err}"), _JSON
        payload, header_length = self.codec(runtime).encode(self.name, number, parsed, outputs)
        self._count(label, "200", time.perf_counter() - started)
        if header_length is None:
            return 200, payload, _JSON
        return 200, payload, [(b"content-type", b"application/octet-stream"),
                              (HEADER_LENGTH.encode(), str(header_length).encode())]  # fmt: skip

    async def asgi(self, scope: dict[str, Any], receive: Receive, send: Send, model: str, version: str | None) -> None:
        """Read the body (refusing one over `MAX_BODY_BYTES` before keeping it), answer, send."""
        started = time.perf_counter()
        headers = {k: v for k, v in scope["headers"] if k in _WANTED_HEADERS}
        if scope["method"] != "POST":
            return await _send(send, 405, error_body("the infer endpoint takes POST"), _JSON)
        declared = headers.get(_CONTENT_LENGTH, b"")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return await _send(send, 400, error_body(f"request body of {int(declared)} bytes is over the limit of {MAX_BODY_BYTES}"), _JSON)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return await _send(send, 400, error_body(f"request body of more than {MAX_BODY_BYTES} bytes is over the limit"), _JSON)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        auth = headers.get(_AUTHORIZATION)
        refusal = None if self.gate is None else self.gate.cached_refusal(auth.decode("latin-1") if auth is not None else None)
        if refusal is not False and size <= INLINE_MAX_BODY_BYTES and self._inline_runtimes():
            status, payload, extra = self(headers, model, version, body, started, refusal)
        else:
            status, payload, extra = await run_in_threadpool(self, headers, model, version, body, started)
        await _send(send, status, payload, extra)

    def _inline_runtimes(self) -> bool:
        state = self.rollout.state
        if self._inline[0] is not state:  # once per rollout state, not per request
            self._inline = (state, all(r.inline_ok for r in state.runtimes.values()))
        return self._inline[1]


async def _send(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
