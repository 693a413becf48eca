"""`hfleet serve MODEL@ALIAS`: an Open Inference Protocol v2 server that follows the registry's rollout."""

from __future__ import annotations

import typer

from hybridfleet.cli.registry import Token, Url


def serve(ref: str = typer.Argument(..., help="NAME@ALIAS (follows its rollout) or NAME@VERSION"),
          fmt: str = typer.Option("auto", "--format", help="auto, onnx, paddle-inference or torch-export"),
          host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8000),
          certs: str | None = typer.Option(None, help="TLS directory of `hfleet certs init` (server.pem, server.key)"),
          insecure_plaintext: bool = typer.Option(False, "--insecure-plaintext", help="serve without TLS (loopback tests only)"),
          no_auth: bool = typer.Option(False, "--no-auth", help="accept requests without a registry token"),
          poll_s: float = typer.Option(2.0, help="seconds between reads of the alias (rollout changes apply within this)"),
          cache_dir: str = typer.Option("~/.hfleet/serve-cache", help="where verified artefacts are kept"),
          threads: int = typer.Option(1, help="runtime threads per request"),
          registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Serve a model's verified exports; each request goes to the alias's stable or canary version by weight."""
    from hybridfleet.registry.client import open_registry
    from hybridfleet.serve.run import serve as run_server

    run_server(open_registry(registry, token), ref, host, port, certs, fmt, cache_dir, poll_s, not no_auth,
               insecure_plaintext, threads)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
