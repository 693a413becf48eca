"""`hfleet run`: the whole job on this machine (shards, workers, site baselines)."""

from __future__ import annotations


import typer
from rich.console import Console
from rich.table import Table

from hybridfleet.errors import LaunchError
from hybridfleet.spec import load_spec


def run(
    job: str = typer.Argument(..., help="the job file"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no live view and no event lines, only the summary (and warnings)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="also echo every process's log lines "
                                 "(they always go to RUN_DIR/logs/)"),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics", help="serve Prometheus metrics from every process "
                                 "and write RUN_DIR/prometheus/targets.json"),
    scalars: str = typer.Option("auto", "--scalars", help="where reported values also go: auto (TensorBoard for "
                                "torch, VisualDL for paddle, if installed), tensorboard, visualdl or off"),
    no_baselines: bool = typer.Option(False, "--no-baselines", help="skip the single-site comparison runs"),
    run_root: str = typer.Option(None, help="where run directories go (default: the job's run_dir)"),
    egress_scan: bool = typer.Option(False, "--egress-scan", help="keep every byte each worker sends and search "
                                                                "it for the worker's own training rows"),
    resume: str = typer.Option(None, "--resume", metavar="RUN_DIR|latest",
                               help="continue an earlier run of this job: its shards restore that run's snapshots "
                                    "(without it every run starts fresh)"),
) -> None:
    """Run JOB here with everything on 127.0.0.1; writes runs/<name>/<timestamp>/summary.json."""
    if quiet:  # the processes' own lines and the supervisor's JSON events; warnings and errors still show
        from hybridfleet.obs import log

        log.configure(level="warning")
    spec = load_spec(job)
    if spec.mode != "ps":
        raise LaunchError("hfleet run starts parameter-server jobs; for mode: collective use `hfleet launch`",
                          hint="run `hfleet launch --framework F --nproc-per-node N SCRIPT` for a collective job")
    import os

    from hybridfleet.launch.psjob import resolve_resume, run_ps_job, snapshot_store
    from hybridfleet.obs.scalars import ENV_SCALARS, resolve_writer

    resolve_writer(scalars, spec.framework)  # refuse an unknown or uninstalled writer before starting anything
    resume_from = resolve_resume(spec, resume, run_root) if resume else None
    if resume_from is not None:
        Console().print(f"resuming run {resume_from}: the shards restore its snapshots from "
                        f"{snapshot_store(spec, resume_from)}", soft_wrap=True, markup=False, highlight=False)
    os.environ[ENV_SCALARS] = scalars
    summary = run_ps_job(spec, job, echo=verbose, show_progress=not quiet, run_root=run_root,
                         baselines=False if no_baselines else None, metrics=metrics,
                         log_to_file=not verbose, egress_scan=egress_scan, resume_from=resume_from)
    _print_summary(summary)
    if not verbose and summary["status"] != "completed":
        _print_failed_logs(summary)
    if summary["status"] == "failed":
        untrained = summary.get("untrained_sites") or {}
        if untrained:
            site, first = next(iter(untrained.items()))
            raise LaunchError(f"job {spec.name} failed: site {', '.join(untrained)} never trained"
                              f"{f' ({first})' if first else ''}; logs in {summary['run_dir']}/logs",
                              hint=f"fix what {site}'s worker log names; min_sites / min_workers_per_site in the "
                                   "job say how many must train")
        raise LaunchError(f"job {spec.name} failed; exit codes {summary['exit_codes']}; logs in {summary['run_dir']}/logs",
                          hint=f"the failing process's log in {summary['run_dir']}/logs ends with its error")


def _print_summary(summary: dict) -> None:
    console = Console()
    table = Table(title=f"{summary['job']} ({summary['framework']}, {summary['sync']})", show_header=True)
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("status", summary["status"])
    if summary["test_accuracy"] is not None or not summary.get("joint_metrics"):
        table.add_row("joint test accuracy", f"{summary['test_accuracy']}")
    for site, acc in summary["site_alone_accuracy"].items():
        table.add_row(f"{site} alone", "-" if acc is None else f"{acc:.4f}")
    for key, value in summary.get("joint_metrics", {}).items():  # metrics other than accuracy (test_bpc, ...)
        if key != "test_accuracy":
            table.add_row(f"joint {key}", f"{value:.4f}")
            for site, alone in summary.get("site_alone_metrics", {}).items():
                table.add_row(f"{site} alone {key}", "-" if key not in alone else f"{alone[key]:.4f}")
    for site, n in summary["bytes_sent_by_site"].items():
        table.add_row(f"bytes sent by {site}", f"{n:,}")
    for site, scan in summary.get("egress_scan", {}).items():
        table.add_row(f"training rows of {site} found in its egress",
                      f"{scan['rows_found']} of {scan['rows_scanned']} ({scan['bytes_scanned']:,} bytes scanned)")
    table.add_row("restarts", f"{summary['restarts']}")
    table.add_row("wall time (s)", f"{summary['wall_s']}")
    console.print(table)
    console.print(f"summary: {summary['run_dir']}/summary.json")
    model = summary.get("model")
    if model:
        best = "" if model["best_step"] is None else f", best step {model['best_step']}"
        # soft_wrap: a path broken over two lines cannot be copied
        console.print(f"model: {model['url']} (final step {model['final_step']}{best}; lineage in MODEL.json)",
                      soft_wrap=True, markup=False, highlight=False)
        registered = model.get("registered")
        if registered:
            console.print(f"registry: {registered['message']}", soft_wrap=True, markup=False, highlight=False)
    if summary.get("report"):
        console.print(f"report: {summary['report']}")


def _print_failed_logs(summary: dict, lines: int = 20) -> None:
    """The last log lines of every process that did not exit 0 (logs are not echoed without --verbose)."""
    from pathlib import Path

    console = Console(stderr=True)
    for name, code in sorted(summary["exit_codes"].items()):
        path = Path(summary["run_dir"]) / "logs" / f"{name}.log"
        if code == 0 or not path.is_file():
            continue
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        console.print(f"--- {name} exited {code}; last {len(tail)} lines of {path} ---", markup=False)
        console.print("\n".join(tail), markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
