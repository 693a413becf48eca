"""`hfleet env`: Environment: check this machine, lock its fingerprint, diff two locks."""

from __future__ import annotations

import typer

group = typer.Typer(help="Environment: check this machine, lock its fingerprint, diff two locks.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="env")
