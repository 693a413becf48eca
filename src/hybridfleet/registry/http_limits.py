"""Limits a REST server enforces before any request reaches its handlers.

`BodyLimit` is a raw ASGI middleware: a request head (path, query, headers) over its cap is
answered 431, a ``Content-Length`` above the cap is answered 413
before a byte of the body is read, and a body sent without one (chunked) is counted as it
streams and cut off at the cap, so no handler, parser or authentication step ever holds
more than ``max_body_bytes``. The whole body must also arrive within ``body_timeout_s``
(408 otherwise): a client trickling bytes cannot hold a request open.

`DeadlineH11Protocol` is uvicorn's h11 protocol with a deadline on the request line and
headers: a connection that has not sent a complete request head ``header_timeout_s``
after it opened (or after its previous response) is closed. uvicorn itself only times
out idle keep-alive connections, so a slowloris client sending one header byte at a time
would otherwise hold its connection for ever. The head's size is bounded by uvicorn's
``h11_max_incomplete_event_size``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY_BYTES = 1 << 20  # registry requests are small JSON documents
MAX_HEADER_BYTES = 16 << 10
BODY_TIMEOUT_S = 30.0
HEADER_TIMEOUT_S = 10.0


async def _refuse(send: Callable, status: int, detail: str) -> None:
    body = json.dumps({"error": "limit", "detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: refuse a request head over ``max_header_bytes`` (431), a body over
    ``max_body_bytes`` (413) or one slower than ``body_timeout_s`` (408), before the app sees it."""

    def __init__(self, app: Any, max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
                 max_header_bytes: int = MAX_HEADER_BYTES):  # fmt: skip
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        head += sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))
        if head > self.max_header_bytes:
            await _refuse(send, 431, f"request head over {self.max_header_bytes} bytes (path, query and headers)")
            return
        cap = self.max_body_bytes
        too_large = f"request body over {cap} bytes; this server accepts at most {cap}"
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                if not value.isdigit() or int(value) > cap:
                    await _refuse(send, 413, too_large if value.isdigit() else "invalid Content-Length")
                    return
        seen = 0
        deadline = time.monotonic() + self.body_timeout_s
        started = refused = False

        async def refuse(status: int, detail: str) -> dict:
            # Answer now, then tell the app the client is gone: a framework that catches errors
            # while reading the body (FastAPI turns them into a 400) never sees the excess bytes.
            nonlocal refused
            if not started and not refused:
                refused = True
                await _refuse(send, status, detail)
            return {"type": "http.disconnect"}

        async def limited_receive() -> dict:
            nonlocal seen
            if refused:
                return {"type": "http.disconnect"}
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                return await refuse(408, f"request body not received within {self.body_timeout_s:g} s")
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    return await refuse(413, too_large)
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if refused:
                return  # the refusal was the answer
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request head is not complete in time."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # still waiting for a complete request head
            if not self.transport.is_closing():
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_deadline is not None and self.cycle is not None and not self.cycle.response_complete:
            self._head_deadline.cancel()  # the head is in: the body has its own deadline (BodyLimit)
            self._head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)
