"""`hfleet ps`: Parameter-server shards (one per machine in real clusters)."""

from __future__ import annotations

import typer

group = typer.Typer(help="Parameter-server shards (one per machine in real clusters).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="ps")
