"""`hfleet run`: the whole job on this machine (shards, workers, site baselines)."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from hybridfleet.errors import LaunchError
from hybridfleet.spec import load_spec


def run(
    job: str = typer.Argument(..., help="the job file"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not echo process logs or the supervisor's event lines"),
    no_baselines: bool = typer.Option(False, "--no-baselines", help="skip the single-site comparison runs"),
    run_root: str = typer.Option(None, help="where run directories go (default: the job's run_dir)"),
) -> None:
    """Run JOB here with everything on 127.0.0.1; writes runs/<name>/<timestamp>/summary.json."""
    if quiet:  # the processes' own lines and the supervisor's JSON events; warnings and errors still show
        from hybridfleet.obs import log

        log.configure(level="warning")
    spec = load_spec(job)
    if spec.mode != "ps":
        raise LaunchError("hfleet run starts parameter-server jobs; for mode: collective use `hfleet launch`",
                          hint="run `hfleet launch --framework F --nproc-per-node N SCRIPT` for a collective job")
    from hybridfleet.launch.psjob import run_ps_job

    summary = run_ps_job(spec, job, echo=not quiet, run_root=run_root, baselines=False if no_baselines else None)
    _print_summary(summary)
    if summary["status"] == "failed":
        raise LaunchError(f"job {spec.name} failed; exit codes {summary['exit_codes']}; logs in {summary['run_dir']}/logs",
                          hint=f"the failing process's log in {summary['run_dir']}/logs ends with its error")


def _print_summary(summary: dict) -> None:
    console = Console()
    table = Table(title=f"{summary['job']} ({summary['framework']}, {summary['sync']})", show_header=True)
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("status", summary["status"])
    table.add_row("joint test accuracy", f"{summary['test_accuracy']}")
    for site, acc in summary["site_alone_accuracy"].items():
        table.add_row(f"{site} alone", "-" if acc is None else f"{acc:.4f}")
    for site, n in summary["bytes_sent_by_site"].items():
        table.add_row(f"bytes sent by {site}", f"{n:,}")
    table.add_row("raw data bytes sent", f"{summary['raw_data_bytes_sent']}")
    table.add_row("restarts", f"{summary['restarts']}")
    table.add_row("wall time (s)", f"{summary['wall_s']}")
    console.print(table)
    console.print(f"summary: {summary['run_dir']}/summary.json")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
