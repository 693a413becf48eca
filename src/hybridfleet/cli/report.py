"""`hfleet report RUN_DIR`: a self-contained HTML report (and PNGs) of one run."""

from __future__ import annotations

from typing import Optional

import typer


def report(
    run_dir: str = typer.Argument(..., help="a run directory written by `hfleet run` (runs/<job>/<timestamp>)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="where to write the HTML (default: RUN_DIR/report.html)"),
) -> None:
    """Write RUN_DIR/report.html: loss, accuracy, bytes, round time, stragglers, events; prints its path."""
    from hybridfleet.obs.report import write_report
    from hybridfleet.obs.runinfo import load_run

    path = write_report(run_dir, out)
    run = load_run(run_dir)
    note = f" (status {run.status}" + (f"; missing {', '.join(run.missing)}" if run.missing else "") + ")"
    typer.echo(f"report: {path}{note}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
