"""`hfleet ckpt`: Checkpoints, local or s3://: ls, show, verify, convert, gc."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from hybridfleet.errors import CheckpointError, UsageError

group = typer.Typer(help="Checkpoints, local or s3://: ls, show, verify, convert, gc.", no_args_is_help=True)

ENDPOINT_HELP = "S3-compatible endpoint URL (default: $AWS_ENDPOINT_URL or AWS)"


def _options(endpoint_url: Optional[str]) -> dict:
    return {"endpoint_url": endpoint_url} if endpoint_url else {}


def _root_and_step(url: str, step: Optional[int]) -> tuple[str, Optional[int]]:
    """A ``.../step-NNNNNNNNNNNN`` folder given where a checkpoint root is expected means that
    step of its parent root."""
    from hybridfleet.ckpt.manifest import parse_step_dir

    named = parse_step_dir(url.rstrip("/"))
    if named is None:
        return url, step
    if step is not None and step != named:
        raise UsageError(f"{url} is the folder of step {named}, but --step {step} was given",
                         hint="give the checkpoint root with --step, or the step folder alone")
    return url.rstrip("/").rsplit("/", 1)[0] or "/", named


@group.command("ls")
def ls(url: str = typer.Argument(..., help="checkpoint root: a path, file:///dir or s3://bucket/prefix"),
       endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """List checkpoints: step, framework, size, age, whether every file passes its size/CRC-32 check, metrics."""
    from hybridfleet.ckpt import list_checkpoints
    from hybridfleet.ckpt.reader import list_steps, read_verified
    from hybridfleet.store import open_store

    store = open_store(url, **_options(endpoint_url))
    infos = list_checkpoints(store)
    if not list_steps(store):
        raise CheckpointError(f"no checkpoints under {url} (the folder is missing or empty)",
                              hint="check the path or URL; checkpoints are the step-* folders a save writes")
    typer.echo(f"{'STEP':>10}  {'FRAMEWORK':<9} {'SIZE':>16}  {'AGE':>11}  {'STATUS':<7}  METRICS")
    for info in infos:
        status = "ok"
        for entry in info.files:
            try:
                read_verified(store, entry)
            except CheckpointError:
                status = "CORRUPT"
                break
        metrics = " ".join(f"{k}={v:g}" for k, v in sorted(info.metrics.items()))
        age_s = time.time() - info.created_s
        typer.echo(f"{info.step:>10}  {info.framework or '-':<9} {info.size_bytes:>14,d} B  {age_s:>7.0f} s ago"
                   f"  {status:<7}  {metrics}".rstrip())


@group.command("show")
def show(url: str = typer.Argument(..., help="checkpoint root (or one step-* folder of it)"),
         step: Optional[int] = typer.Option(None, help="step to show (default: newest valid)"),
         endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Verify and describe one checkpoint as JSON: step, framework, metrics, state and files."""
    from hybridfleet.ckpt import load_checkpoint

    url, step = _root_and_step(url, step)
    info = load_checkpoint(url, step=step, **_options(endpoint_url))
    tensors = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in (info.tensors or {}).items()}
    out = {
        "url": info.url, "step": info.step, "framework": info.framework, "framework_version": info.framework_version,
        "created_s": info.created_s, "size_bytes": info.size_bytes, "metrics": info.metrics, "state": info.state,
        "files": [{"name": f.name, "role": f.role, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in info.files],
        "tensors": tensors,
    }  # fmt: skip
    typer.echo(json.dumps(out, indent=2))


@group.command("verify")
def verify(url: str = typer.Argument(..., help="checkpoint root (or one step-* folder of it)"),
           step: Optional[int] = typer.Option(None, help="verify only this step"),
           endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Check size and sha256 of every file; exit code 11 if any checkpoint is invalid."""
    from hybridfleet.ckpt import verify as verify_all

    url, step = _root_and_step(url, step)
    results = verify_all(url, step=step, **_options(endpoint_url))
    for r in results:
        typer.echo(f"{r.step:>10}  {'ok' if r.ok else 'INVALID'}  {r.problem}".rstrip())
    bad = [r.step for r in results if not r.ok]
    if not results:
        raise CheckpointError(f"no checkpoint folders under {url}",
                              hint="check the path or URL; checkpoints are the step-* folders a save writes")
    if bad:
        newest_ok = max((r.step for r in results if r.ok), default=None)
        newest = f"the newest valid one is step {newest_ok}" if newest_ok is not None else "none is valid"
        raise CheckpointError(f"{len(bad)} of {len(results)} checkpoints are invalid (steps {bad}); {newest}",
                              hint="`hfleet ckpt gc URL` removes the invalid ones; a load uses the newest valid one")


@group.command("convert")
def convert(src: str = typer.Argument(..., help="source checkpoint root"),
            dst: str = typer.Argument(..., help="destination checkpoint root"),
            to: str = typer.Option(..., "--to", help="target framework: torch or paddle"),
            step: Optional[int] = typer.Option(None, help="step to convert (default: newest valid)"),
            endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Convert a checkpoint's model weights to the other framework's layout (optimizer state is dropped)."""
    from hybridfleet.ckpt import convert_checkpoint

    if to not in ("torch", "paddle"):
        raise typer.BadParameter(f"--to must be torch or paddle (got {to!r})")
    opts = _options(endpoint_url)
    info = convert_checkpoint(src, dst, to, step=step, src_options=opts, dst_options=opts)
    typer.echo(f"wrote step {info.step} for {to} to {info.url}")


@group.command("gc")
def gc(url: str = typer.Argument(..., help="checkpoint root"),
       keep_last: Optional[int] = typer.Option(None, help="keep the newest N checkpoints"),
       best_metric: Optional[str] = typer.Option(None, help="also keep the best checkpoint by this metric"),
       mode: str = typer.Option("max", help="whether the best metric is the max or the min"),
       dry_run: bool = typer.Option(False, help="report what would be removed, remove nothing"),
       endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Remove old checkpoints and unreferenced blobs; the newest valid checkpoint is always kept."""
    from hybridfleet.ckpt import gc as run_gc

    try:
        result = run_gc(url, keep_last=keep_last, best_metric=best_metric, best_mode=mode, dry_run=dry_run, **_options(endpoint_url))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    verb = "would remove" if dry_run else "removed"
    typer.echo(f"kept steps {result.kept_steps}; {verb} steps {result.removed_steps} and {result.removed_blobs} blobs ({result.freed_bytes:,d} B)")


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="ckpt")
