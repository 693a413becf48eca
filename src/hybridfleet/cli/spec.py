"""`hfleet spec check`: validate a job file and print the resolved spec."""

from __future__ import annotations

from typing import Optional

import typer
import yaml

from hybridfleet.codec.advice import spec_advice
from hybridfleet.errors import SpecError
from hybridfleet.spec import load_spec
from hybridfleet.spec.preflight import check_here

group = typer.Typer(help="Job files: validate and show the resolved spec.", no_args_is_help=True)


@group.command("check")
def check(job: str = typer.Argument(..., help="path of the YAML job file"),
          site: Optional[list[str]] = typer.Option(None, "--site", metavar="SITE",
                                                   help="check only these sites' entrypoints and data (on a "
                                                        "site's own host; default: every site)"),
          no_data: bool = typer.Option(False, "--no-data", help="do not open the sites' datasets")) -> None:
    """Validate JOB and what this machine can check of it (entrypoints exist and import the job's framework,
    local site datasets open, the extras a block needs are installed); print the resolved spec."""
    spec = load_spec(job)
    try:
        check_here(spec, site or None, data=not no_data)
    except SpecError as err:
        raise SpecError(f"{job}: {err}", hint=err.hint) from None
    typer.echo(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), nl=False)
    advice = spec_advice(spec.ps.compression) if spec.mode == "ps" else None
    if advice:
        typer.echo(f"note: {advice}", err=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="spec")
