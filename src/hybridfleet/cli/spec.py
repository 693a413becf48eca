"""`hfleet spec check`: validate a job file and print the resolved spec."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from hybridfleet.codec.advice import spec_advice
from hybridfleet.errors import SpecError
from hybridfleet.spec import load_spec

group = typer.Typer(help="Job files: validate and show the resolved spec.", no_args_is_help=True)


@group.command("check")
def check(job: str = typer.Argument(..., help="path of the YAML job file")) -> None:
    """Validate JOB; print the resolved spec (defaults filled) or every error with its field path."""
    spec = load_spec(job)
    if not Path(spec.entrypoint).is_file():
        raise SpecError(f"{job}: entrypoint: {spec.entrypoint!r} is not a file (relative paths start at {Path.cwd()})",
                        hint="fix entrypoint in the job file, or run the command from the folder it is relative to")
    typer.echo(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), nl=False)
    advice = spec_advice(spec.ps.compression) if spec.mode == "ps" else None
    if advice:
        typer.echo(f"note: {advice}", err=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="spec")
