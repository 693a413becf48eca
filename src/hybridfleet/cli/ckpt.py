"""`hfleet ckpt`: Checkpoints, local or s3://: ls, show, verify, convert, gc."""

from __future__ import annotations

import typer

group = typer.Typer(help="Checkpoints, local or s3://: ls, show, verify, convert, gc.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="ckpt")
