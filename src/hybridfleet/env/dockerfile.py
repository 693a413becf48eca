"""Render a Dockerfile on an official base image from a lock, and the image tag.

The Dockerfile pins the locked distributions hybridfleet needs at run time
(`hybridfleet.env.runtime_deps`: no test tools), except those the base image
brings (the framework and its CUDA libraries), the other framework's family
(a job trains with one), and distributions installed from a local directory
(they arrive with the copied project). A locked version the image's Python
When the image runs another Python than the lock was made on (the Paddle images ship
3.10), pins become caps (``name<=version``): pip installs the newest release up to the
locked one that supports the image's Python (numpy 2.3+ needs 3.11). It sets ``HFLEET_IMAGE_LOCK_HASH`` so a
running container can say which lock it was built from. Output is
byte-for-byte deterministic: the same inputs give the same file and tag.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from hybridfleet.env.images import BaseImage, base_version, load_table
from hybridfleet.errors import SpecError

DEFAULT_REPOSITORY = "hfleet"
HASH_CHARS_IN_TAG = 12
CUDA_WHEEL_PREFIXES = ("nvidia-",)  # CUDA runtime wheels (nvidia-cudnn-cu12, nvidia-nccl-cu12, ...)


@dataclass(frozen=True)
class RenderedImage:
    """A rendered Dockerfile, the tag to build it as, and what was pinned or left out."""

    dockerfile: str
    tag: str
    requirements: list[str]
    left_out: dict[str, str]  # distribution -> why
    python: str = ""  # the image's Python minor version


def image_tag(lock_hash_hex: str, name: str, base: BaseImage, registry: str | None = None) -> str:
    """``<registry or hfleet>/<name>:<12 hex of lock hash>-<framework><version>-<cpu|cudaX.Y>``.

    The same lock and base give the same tag; a changed lock gives another.
    """
    if not re.fullmatch(r"[0-9a-f]{64}", lock_hash_hex):
        raise ValueError(f"lock hash must be 64 hex characters (got {lock_hash_hex!r})")
    if not re.fullmatch(r"[a-z0-9]+([._-][a-z0-9]+)*", name):
        raise ValueError(f"image name must be lowercase letters, digits and . _ - (got {name!r})")
    repo = (registry or DEFAULT_REPOSITORY).rstrip("/")
    return f"{repo}/{name}:{lock_hash_hex[:HASH_CHARS_IN_TAG]}-{base.framework}{base.version}-{base.flavour}"


def _other_families(framework: str) -> set[str]:
    table = load_table()["frameworks"]
    return {d for name, entry in table.items() if name != framework for d in entry["family"]}


def image_python(lock: dict[str, Any], base: BaseImage) -> str:
    """The Python minor version the image runs: the base image's, else (a plain Python image) the lock's."""
    return base.python or lock["python"]["minor"]


def select_requirements(lock: dict[str, Any], base: BaseImage, extras: tuple[str, ...] = (),
                        distributions: tuple[str, ...] = ()) -> tuple[list[str], list[str], dict[str, str]]:
    """Split the lock's distributions into (pins to pip install, framework pins, left out with reasons).

    What runs: hybridfleet with `RUNTIME_EXTRAS` + ``extras`` (the job's blocks), the framework,
    and ``distributions`` (what the job's script imports), each with its requirements.
    Framework pins are only non-empty when the framework is pip-installed on a
    plain Python image (torch on CPU); they then come from its own wheel index.
    """
    from hybridfleet.env.runtime_deps import FRAMEWORK_DISTRIBUTIONS, RUNTIME_EXTRAS, dev_tools, runtime_closure

    python = image_python(lock, base)
    exact = python == lock["python"]["minor"]
    runtime = runtime_closure(python, RUNTIME_EXTRAS + tuple(extras),
                              (FRAMEWORK_DISTRIBUTIONS.get(base.framework, base.framework), *distributions))
    tools = dev_tools(python)
    local = set(lock.get("local_distributions", []))
    others = _other_families(base.framework)
    pins: list[str] = []
    framework_pins: list[str] = []
    left_out: dict[str, str] = {}
    for name, version in sorted(lock["distributions"].items()):
        if name in local:
            left_out[name] = "installed from a local directory; comes with the copied project"
        elif name in others:
            left_out[name] = "belongs to the other framework"
        elif name.startswith(CUDA_WHEEL_PREFIXES):
            left_out[name] = ("CUDA library; the base image brings CUDA" if base.device == "gpu"
                              else "CUDA library; a cpu image needs none")
        elif base.pip_index and name in base.family:
            framework_pins.append(f"{name}=={base_version(version)}")
        elif name in base.provided or name.startswith(base.provided_prefixes):
            left_out[name] = "the base image provides it"
        elif runtime is not None and name not in runtime:
            left_out[name] = ("not needed at run time (a test or development tool)" if name in tools
                              else "not needed at run time (imported by nothing the job runs)")
        elif exact:
            pins.append(f"{name}=={version}")
        else:  # made on another Python: the newest release up to the locked one that installs on the image's
            pins.append(f"{name}<={version}")
    if base.pip_index and not any(p.startswith(f"{base.framework}==") for p in framework_pins):
        framework_pins.insert(0, f"{base.framework}=={base.version}")
    return pins, framework_pins, left_out


def _check_framework_matches(lock: dict[str, Any], base: BaseImage, lock_name: str) -> None:
    locked = lock.get("frameworks", {}).get(base.framework)
    if locked and base_version(locked["version"]) != base.version:
        raise SpecError(
            f"environment.version: {base.framework} {base.version} differs from the lock's "
            f"{base.framework} {base_version(locked['version'])} ({lock_name}); use the lock's version "
            f"or regenerate the lock with {base.framework} {base.version} installed"
        )


def _continued(command: str, items: list[str]) -> list[str]:
    items = [shlex.quote(item) for item in items]  # 'numpy<=2.4.6': < is a shell redirection
    lines = [f"RUN {command} \\"]
    lines += [f"      {item} \\" for item in items[:-1]]
    lines.append(f"      {items[-1]}")
    return lines


def render_dockerfile(
    lock: dict[str, Any],
    base: BaseImage,
    *,
    name: str,
    registry: str | None = None,
    lock_source: str = "hfleet.lock.json",
    extras: tuple[str, ...] = (),
    distributions: tuple[str, ...] = (),
) -> RenderedImage:
    """The Dockerfile text and tag for ``lock`` on ``base`` (see the module docstring).

    Raises SpecError when the lock pins a different version of the image's framework.
    """
    _check_framework_matches(lock, base, lock_source)
    tag = image_tag(lock["hash"], name, base, registry)
    pins, framework_pins, left_out = select_requirements(lock, base, extras, distributions)
    device = f"gpu, CUDA {base.cuda}, cuDNN {base.cudnn}" if base.device == "gpu" else "cpu"
    lines = [
        "# syntax=docker/dockerfile:1",
        "# Rendered by `hfleet image render`; regenerate it rather than edit it.",
        f"# framework: {base.framework} {base.version} ({device})",
        f"# lock: {lock_source} (sha256 {lock['hash']})",
        f"# image: {tag}",
    ]
    if base.pip_index:
        lines.append(f"# {base.framework} publishes no CPU image: official Python image + CPU wheels from {base.pip_index}")
    locked_python = lock["python"]["minor"]
    if base.python and base.python != locked_python:
        lines.append(f"# note: the lock was made on Python {locked_python}; this base image runs Python {base.python}, "
                     "so versions are capped at the locked ones rather than pinned")
    for dist, why in sorted(left_out.items()):
        lines.append(f"# not pip-installed: {dist} ({why})")
    lines += [
        f"FROM {base.ref}",
        "ENV PYTHONUNBUFFERED=1 \\",
        "    PIP_NO_CACHE_DIR=1 \\",
        "    PIP_DISABLE_PIP_VERSION_CHECK=1 \\",
        "    PIP_BREAK_SYSTEM_PACKAGES=1",
        "WORKDIR /workspace",
    ]
    if framework_pins:
        lines += _continued(f"python -m pip install --index-url {base.pip_index}", framework_pins)
    if pins:
        lines += _continued("python -m pip install", pins)
    lines += [
        "COPY . /workspace",
        "RUN if [ -f pyproject.toml ] || [ -f setup.py ]; then python -m pip install /workspace; fi",
        f"ENV HFLEET_IMAGE_LOCK_HASH={lock['hash']} \\",
        f"    HFLEET_IMAGE={tag}",
        f"LABEL io.hybridfleet.lock-hash=\"{lock['hash']}\" \\",
        f"      io.hybridfleet.framework=\"{base.framework} {base.version} {base.flavour}\"",
    ]
    return RenderedImage("\n".join(lines) + "\n", tag, framework_pins + pins, left_out, image_python(lock, base))


# Build context entries the image must not copy (written as <Dockerfile>.dockerignore, which
# BuildKit reads next to the Dockerfile, or .dockerignore at the context root).
DOCKERIGNORE = """\
.git
.venv
.venv*/
**/__pycache__
*.pyc
runs/
k8s/
.pytest_cache/
*.egg-info/
build/
dist/
certs/
**/*.key
"""
