"""`hfleet k8s`: Kubernetes / Kubeflow manifests."""

from __future__ import annotations

from pathlib import Path

import typer

group = typer.Typer(help="Kubernetes / Kubeflow manifests.", no_args_is_help=True)


@group.command("render")
def render(
    job: Path = typer.Argument(..., help="job file (YAML)"),
    out_dir: Path = typer.Option(Path("k8s"), "--out", "-o", help="directory for the manifests"),
) -> None:
    """Render JOB as Kubernetes manifests: Kubeflow PyTorchJob/PaddleJob (collective) or StatefulSet + Jobs (ps)."""
    from hybridfleet.k8s.render import render_job_file, write_manifests

    for path in write_manifests(render_job_file(job), out_dir):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="k8s")
