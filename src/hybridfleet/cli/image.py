"""`hfleet image`: Container images on the official PaddlePaddle / PyTorch base tags."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from hybridfleet.env.dockerfile import RenderedImage, render_dockerfile
from hybridfleet.env.images import base_version, resolve_base_image
from hybridfleet.env.lock import make_lock, read_lock
from hybridfleet.env.probe import FRAMEWORKS

group = typer.Typer(help="Container images on the official PaddlePaddle / PyTorch base tags.", no_args_is_help=True)


@dataclass
class _Request:
    framework: str
    version: str | None
    device: str
    cuda: str | None
    lock_path: str | None
    name: str
    registry: str | None


def _request(job: str | None, framework: str | None, version: str | None, device: str | None,
             cuda: str | None, lock: str | None) -> _Request:
    if job:
        from hybridfleet.spec import load_spec

        spec = load_spec(job)
        env = spec.environment
        if framework and framework != spec.framework:
            raise typer.BadParameter(f"{framework} differs from the job's framework {spec.framework}",
                                     param_hint="--framework")
        lock_path = lock or (str(Path(job).parent / env.lock) if env.lock and not Path(env.lock).is_absolute()
                             else env.lock)
        return _Request(spec.framework, version or env.version, device or env.device, cuda or env.cuda,
                        lock_path, spec.name, env.registry)
    if not framework:
        raise typer.BadParameter("give a job file, or --framework with --version and --device", param_hint="JOB")
    if framework not in FRAMEWORKS:
        raise typer.BadParameter(f"must be one of {sorted(FRAMEWORKS)} (got {framework!r})", param_hint="--framework")
    return _Request(framework, version, device or "cpu", cuda, lock, framework, None)


def _installed_version(framework: str) -> str | None:
    for dist in FRAMEWORKS[framework]["distributions"]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _render(job, framework, version, device, cuda, lock, mirror) -> RenderedImage:
    req = _request(job, framework, version, device, cuda, lock)
    if req.lock_path:
        lock_data, lock_source = read_lock(req.lock_path), Path(req.lock_path).name
    else:
        lock_data, lock_source = make_lock(), "this machine (no lock file given)"
    locked = lock_data["frameworks"].get(req.framework, {}).get("version")
    chosen = req.version or locked or _installed_version(req.framework)
    if chosen is None:
        raise typer.BadParameter(f"{req.framework} is neither in the lock nor installed; give its version",
                                 param_hint="--version")
    locked_cuda = lock_data["frameworks"].get(req.framework, {}).get("cuda")
    wanted_cuda = req.cuda or (".".join(locked_cuda.split(".")[:2]) if locked_cuda and req.device == "gpu" else None)
    base = resolve_base_image(req.framework, base_version(chosen), req.device, wanted_cuda,
                              python=lock_data["python"]["minor"], mirror=mirror)
    return render_dockerfile(lock_data, base, name=req.name, registry=req.registry, lock_source=lock_source)


_JOB = typer.Argument(None, help="job file; its environment section supplies the defaults")
_FRAMEWORK = typer.Option(None, "--framework", help="torch or paddle (without a job file)")
_VERSION = typer.Option(None, "--version", help="framework version (default: the lock's, else the installed one)")
_DEVICE = typer.Option(None, "--device", help="cpu or gpu (default: the job's, else cpu)")
_CUDA = typer.Option(None, "--cuda", help="CUDA X.Y for gpu (default: the lock's, else the newest published)")
_LOCK = typer.Option(None, "--lock", help="hfleet.lock.json to pin (default: the job's, else this machine)")
_MIRROR = typer.Option(False, "--mirror", help="pull the base image from Baidu's registry (paddle)")


@group.command("render")
def render(
    job: Optional[str] = _JOB,
    framework: Optional[str] = _FRAMEWORK,
    version: Optional[str] = _VERSION,
    device: Optional[str] = _DEVICE,
    cuda: Optional[str] = _CUDA,
    output: Optional[str] = typer.Option(None, "--output", "-o", help="write the Dockerfile here (default: stdout)"),
    lock: Optional[str] = _LOCK,
    mirror: bool = _MIRROR,
) -> None:
    """Render a Dockerfile on the official base image, pinned to a lock; print the image tag."""
    rendered = _render(job, framework, version, device, cuda, lock, mirror)
    if output:
        Path(output).write_text(rendered.dockerfile)
        typer.echo(f"wrote {output}")
        typer.echo(f"image tag: {rendered.tag}")
    else:
        typer.echo(rendered.dockerfile, nl=False)
        typer.echo(f"image tag: {rendered.tag}", err=True)


@group.command("build")
def build(
    job: Optional[str] = _JOB,
    framework: Optional[str] = _FRAMEWORK,
    version: Optional[str] = _VERSION,
    device: Optional[str] = _DEVICE,
    cuda: Optional[str] = _CUDA,
    lock: Optional[str] = _LOCK,
    mirror: bool = _MIRROR,
    context: str = typer.Option(".", "--context", help="build context: the project directory to copy in"),
) -> None:
    """Render the Dockerfile and run `docker build` with it (needs a Docker engine)."""
    from hybridfleet.env.docker import build_image, require_docker_engine

    require_docker_engine()
    rendered = _render(job, framework, version, device, cuda, lock, mirror)
    build_image(rendered.dockerfile, rendered.tag, context, on_line=typer.echo)
    typer.echo(f"built {rendered.tag}")


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="image")
