"""`hfleet spec check`: validate a job file and print the resolved spec."""

from __future__ import annotations

import typer
import yaml

from hybridfleet.spec import load_spec

group = typer.Typer(help="Job files: validate and show the resolved spec.", no_args_is_help=True)


@group.command("check")
def check(job: str = typer.Argument(..., help="path of the YAML job file")) -> None:
    """Validate JOB; print the resolved spec (defaults filled) or every error with its field path."""
    spec = load_spec(job)
    typer.echo(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), nl=False)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="spec")
