"""Start `hfleet serve`: open the registry, load the rollout, serve OIP v2 over HTTP(S) until interrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridfleet.errors import UsageError
from hybridfleet.registry.refs import parse_ref
from hybridfleet.serve.auth import TokenGate, registry_reader_check
from hybridfleet.serve.export import TAG_PREFIX
from hybridfleet.serve.runtime import FORMATS
from hybridfleet.serve.routing import Rollout, poll_interval_ok
from hybridfleet.serve.server import ServeMetrics, create_app

DEFAULT_CACHE = "~/.hfleet/serve-cache"


def choose_format(reg: Any, ref: str, fmt: str) -> str:
    """``fmt``, or with "auto" the first of onnx, paddle-inference, torch-export the version has a verified export of."""
    if fmt != "auto":
        if fmt not in FORMATS:
            raise UsageError(f"--format must be auto or one of {', '.join(FORMATS)} (got {fmt!r})")
        return fmt
    tags = reg.resolve_version(ref).tags
    for candidate in ("onnx", "paddle-inference", "torch-export"):
        if f"{TAG_PREFIX}.{candidate}.uri" in tags:
            return candidate
    raise UsageError(f"{ref} has no verified export; run `hfleet registry export {ref} --format onnx --model ... -o DIR` first")


def build(reg: Any, ref: str, fmt: str = "auto", cache_dir: str = DEFAULT_CACHE, poll_s: float = 2.0,
          auth: bool = True, threads: int = 1, token_ttl_s: float = 5.0) -> tuple[Any, Rollout]:  # fmt: skip
    """(ASGI app, its started Rollout) for ``ref``; the caller runs the app and stops the rollout."""
    parse_ref(ref)
    poll_interval_ok(poll_s)
    if not 1 <= threads <= 256:
        raise UsageError(f"--threads must be between 1 and 256 (got {threads})")
    metrics = ServeMetrics()
    rollout = Rollout(reg, ref, choose_format(reg, ref, fmt), Path(cache_dir).expanduser(), poll_s, threads,
                      on_refresh_error=lambda err: metrics.refresh_errors.labels(parse_ref(ref).name).inc())  # fmt: skip
    gate = TokenGate(registry_reader_check(reg, rollout.full_name), token_ttl_s) if auth else None
    rollout.start()
    return create_app(rollout, gate, metrics), rollout


def serve(reg: Any, ref: str, host: str, port: int, certs: str | None, fmt: str = "auto", cache_dir: str = DEFAULT_CACHE,
          poll_s: float = 2.0, auth: bool = True, insecure_plaintext: bool = False, threads: int = 1) -> None:  # fmt: skip
    """Serve ``ref`` until interrupted: TLS with ``certs`` (server.pem/server.key of `hfleet certs init`),
    plaintext only with ``insecure_plaintext``."""
    import uvicorn

    from hybridfleet.security.certs import load_pki

    if certs is None and not insecure_plaintext:
        raise UsageError("--certs DIR is required (TLS); for a loopback test pass --insecure-plaintext explicitly")
    tls: dict[str, str] = {}
    if certs is not None:
        pki = load_pki(certs)
        tls = {"ssl_certfile": str(pki.server_cert), "ssl_keyfile": str(pki.server_key)}
    from hybridfleet.launch.preflight import listen

    sock = listen(host, port, "hfleet serve")  # a port in use is refused before the model is loaded
    try:
        app, rollout = build(reg, ref, fmt, cache_dir, poll_s, auth, threads)
        try:
            uvicorn.Server(uvicorn.Config(app, log_level="warning", **tls)).run(sockets=[sock])
        finally:
            rollout.stop()
    finally:
        sock.close()
