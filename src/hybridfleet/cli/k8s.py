"""`hfleet k8s`: Kubernetes / Kubeflow manifests."""

from __future__ import annotations

import typer

group = typer.Typer(help="Kubernetes / Kubeflow manifests.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="k8s")
