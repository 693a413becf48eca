"""`hfleet certs`: TLS certificates and signed tokens for real deployments."""

from __future__ import annotations

import typer

group = typer.Typer(help="TLS certificates and signed tokens for real deployments.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="certs")
