"""`hfleet image`: Container images on the official PaddlePaddle / PyTorch base tags."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hybridfleet.env.dockerfile import DOCKERIGNORE, RenderedImage
from hybridfleet.env.image_request import image_request, render_request

group = typer.Typer(help="Container images on the official PaddlePaddle / PyTorch base tags.", no_args_is_help=True)


def _render(job, framework, version, device, cuda, lock, mirror) -> RenderedImage:
    return render_request(image_request(job, framework, version, device, cuda, lock), mirror)


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
    tag_only: bool = typer.Option(False, "--tag-only", help="print only the image tag (for scripts: "
                                                            "`hfleet k8s render JOB --image \"$(...)\"`)"),
) -> None:
    """Render a Dockerfile on the official base image, pinned to a lock; print the image tag.

    With -o, the build-context exclusions are written next to it as ``<output>.dockerignore``.
    """
    rendered = _render(job, framework, version, device, cuda, lock, mirror)
    if tag_only:
        typer.echo(rendered.tag)
        return
    if output:
        Path(output).write_text(rendered.dockerfile)
        Path(f"{output}.dockerignore").write_text(DOCKERIGNORE)
        typer.echo(f"wrote {output} and {output}.dockerignore")
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
    tag: Optional[str] = typer.Option(None, "--tag", "-t", help="tag the image as this (default: the lock-derived tag)"),
) -> None:
    """Render the Dockerfile and run `docker build` with it (needs a Docker engine)."""
    from hybridfleet.env.docker import build_image, require_docker_engine

    rendered = _render(job, framework, version, device, cuda, lock, mirror)
    require_docker_engine()
    name = tag or rendered.tag
    build_image(rendered.dockerfile, name, context, on_line=typer.echo, dockerignore=DOCKERIGNORE)
    typer.echo(f"built {name}")


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="image")
