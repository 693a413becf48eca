"""`hfleet env`: Environment: check this machine, lock its fingerprint, diff two locks."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from hybridfleet.env.check import check_environment, raise_for_problems
from hybridfleet.env.diff import diff_locks, summarize
from hybridfleet.env.lock import DEFAULT_LOCK_FILE, make_lock, read_lock, write_lock
from hybridfleet.env.smoke import SMOKE_TIMEOUT_S
from hybridfleet.errors import EnvDriftError, UsageError

group = typer.Typer(help="Environment: check this machine, lock its fingerprint, diff two locks.", no_args_is_help=True)


class Framework(str, Enum):
    torch = "torch"
    paddle = "paddle"


def _gib(n_bytes: int | None) -> str:
    return "?" if n_bytes is None else f"{n_bytes / 2**30:.1f} GiB"


def _check_table(report: dict[str, Any]) -> Table:
    table = Table(title="hfleet env check", show_lines=False)
    table.add_column("item")
    table.add_column("value")
    cpu, mem, gpus = report["cpu"], report["memory"], report["gpus"]
    table.add_row("python", f"{report['python']['version']} ({report['python']['implementation']})")
    table.add_row("os", f"{report['os']['system']} {report['os']['release']} {report['os']['machine']}, "
                        f"glibc {report['os']['glibc'] or '-'}")
    table.add_row("cpu", f"{cpu['model'] or '?'}: {cpu['logical_cores']} logical, "
                         f"{cpu['physical_cores'] or '?'} physical, {cpu['usable_cores']} usable")
    table.add_row("memory", f"{_gib(mem['total_bytes'])} total, {_gib(mem['available_bytes'])} available")
    table.add_row("gpus", f"{gpus['count']} ({', '.join(gpus['names']) or gpus['source']}), driver {gpus['driver'] or '-'}")
    for name, fw in report["frameworks"].items():
        if not fw["installed"]:
            table.add_row(name, f"[red]missing[/red]: {fw['error']}")
            continue
        table.add_row(name, f"{fw['version']}, CUDA {fw['cuda'] or '-'} (compiled: {fw['cuda_compiled']}), "
                            f"cuDNN {fw['cudnn'] or '-'}, NCCL {fw['nccl'] or '-'}")
        table.add_row(f"{name} devices", ", ".join(fw["devices"]) or "none (CPU only)")
        table.add_row(f"{name} backends", ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in fw["backends"].items()))
        smoke = fw["smoke"]
        if smoke is None:
            table.add_row(f"{name} all-reduce", "skipped")
        elif smoke["ok"]:
            table.add_row(f"{name} all-reduce", f"[green]ok[/green] ({smoke['backend']}, {smoke['world_size']} "
                                                f"processes, {smoke['duration_s']:.1f} s)")
        else:
            table.add_row(f"{name} all-reduce", f"[red]failed[/red]: {smoke['error']}")
    return table


@group.command("check")
def check(
    framework: Optional[Framework] = typer.Option(None, "--framework", "-f", help="check only this framework"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (keys: see hybridfleet.env.check)"),
    job: Optional[str] = typer.Option(None, "--job", help="job file: check its framework and its GPU needs"),
    smoke: bool = typer.Option(True, "--smoke/--no-smoke", help="run the 2-process all-reduce test"),
    timeout_s: float = typer.Option(SMOKE_TIMEOUT_S, "--timeout-s", help="bound for each all-reduce smoke test"),
) -> None:
    """Is this machine able to train? Host, frameworks, devices and a real all-reduce."""
    names = [framework.value] if framework else None
    gpus_required = 0
    if job:
        from hybridfleet.spec import load_spec

        spec = load_spec(job)
        names = names or [spec.framework]
        gpus_required = max(spec.resources.gpus, 1 if spec.environment.device == "gpu" else 0)
    report = check_environment(names, smoke=smoke, gpus_required=gpus_required, timeout_s=timeout_s)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        Console().print(_check_table(report))
    raise_for_problems(report)


@group.command("lock")
def lock(
    output: str = typer.Option(DEFAULT_LOCK_FILE, "--output", "-o", help="where to write the lock"),
    image: Optional[str] = typer.Option(None, "--image", help="container image reference or digest (else $HFLEET_IMAGE)"),
) -> None:
    """Write this environment's fingerprint (versions, CUDA, every package, a content hash)."""
    if not Path(output).parent.is_dir():
        raise UsageError(f"--output {output}: the folder {Path(output).parent} does not exist",
                         hint="create the folder first, or pass --output a path in an existing folder")
    data = make_lock(image=image)
    path = write_lock(data, output)
    typer.echo(f"wrote {path} (sha256 {data['hash'][:12]}..., {len(data['distributions'])} distributions)")


@group.command("diff")
def diff(
    a: str = typer.Argument(..., help="first lock file (e.g. the laptop's)"),
    b: str = typer.Argument(..., help="second lock file (e.g. the cloud image's)"),
    as_json: bool = typer.Option(False, "--json", help="print {a, b, differences, counts} as JSON"),
) -> None:
    """List what differs between two locks; exit 1 on error-level drift."""
    lock_a, lock_b = read_lock(a), read_lock(b)
    differences = diff_locks(lock_a, lock_b)
    counts = summarize(differences)
    if as_json:
        typer.echo(json.dumps({"a": a, "b": b, "differences": [d.to_dict() for d in differences],
                               "counts": counts}, indent=2))
    elif not differences:
        typer.echo(f"{a} and {b} describe the same environment")
    else:
        table = Table(title=f"{a} -> {b}")
        for column in ("severity", "what", "A", "B"):
            table.add_column(column)
        colour = {"error": "red", "warning": "yellow", "info": "dim"}
        for d in differences:
            table.add_row(f"[{colour[d.severity]}]{d.severity}[/]", d.path, str(d.a), str(d.b))
        Console().print(table)
        typer.echo(", ".join(f"{n} {s}(s)" for s, n in counts.items()))
    if counts["error"]:
        raise EnvDriftError(f"{counts['error']} error-level difference(s) between {a} and {b}: "
                            + "; ".join(d.message for d in differences if d.severity == "error"))


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="env")
