"""`hfleet image`: Container images on the official PaddlePaddle / PyTorch base tags."""

from __future__ import annotations

import typer

group = typer.Typer(help="Container images on the official PaddlePaddle / PyTorch base tags.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="image")
