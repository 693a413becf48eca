"""The published base images (data in ``base_images.json``) and choosing one.

PaddlePaddle: ``paddlepaddle/paddle:<ver>`` for CPU and
``paddlepaddle/paddle:<ver>-gpu-cuda<X.Y>-cudnn<Z>`` for GPU (3.0.0 tags also
carry ``-trt``), or the same tags on Baidu's registry with ``mirror=True``.
PyTorch: ``pytorch/pytorch:<ver>-cuda<X.Y>-cudnn<Z>-runtime`` for GPU; upstream
publishes no CPU image, so CPU renders use ``python:<minor>-slim`` plus the CPU
wheel index. A combination missing from the table is refused, listing the
published ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from hybridfleet.env.probe import known_framework
from hybridfleet.errors import UnsupportedImageError

DEVICES = ("cpu", "gpu")


@lru_cache(maxsize=1)
def load_table() -> dict[str, Any]:
    """The base-image table shipped with the package (read once; it is immutable package data)."""
    return json.loads(resources.files("hybridfleet.env").joinpath("base_images.json").read_text())


@dataclass(frozen=True)
class BaseImage:
    """A chosen base image and what the Dockerfile needs to know about it."""

    framework: str
    version: str
    device: str
    ref: str
    cuda: str | None = None
    cudnn: str | None = None
    python: str | None = None
    pip_index: str | None = None  # set when the framework is pip-installed on a plain Python image
    family: tuple[str, ...] = ()
    provided: tuple[str, ...] = ()
    provided_prefixes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def flavour(self) -> str:
        """``cpu`` or ``cuda<X.Y>``."""
        return f"cuda{self.cuda}" if self.device == "gpu" else "cpu"


def base_version(version: str) -> str:
    """A framework version without its local part (``2.13.0+cpu`` -> ``2.13.0``)."""
    return version.split("+", 1)[0].strip()


def published(framework: str) -> list[str]:
    """Every published combination for ``framework`` as ``"<ver> cpu"`` / ``"<ver> gpu cuda<X.Y>"``,
    newest version first (compared as versions: 2.10.0 is newer than 2.5.1)."""
    from packaging.version import Version

    entry = load_table()["frameworks"][framework]
    out = []
    for version, flavours in sorted(entry["versions"].items(), key=lambda item: Version(item[0]), reverse=True):
        if flavours.get("cpu"):
            out.append(f"{version} cpu")
        out.extend(f"{version} gpu cuda{cuda}" for cuda in flavours.get("gpu", {}))
    return out


def _refuse(framework: str, what: str, choices: list[str]) -> UnsupportedImageError:
    return UnsupportedImageError(f"{what} has no official base image; published for {framework}: {', '.join(choices)}")


def resolve_base_image(
    framework: str,
    version: str,
    device: str = "cpu",
    cuda: str | None = None,
    *,
    python: str | None = None,
    mirror: bool = False,
) -> BaseImage:
    """The official base image for this combination.

    ``cuda`` defaults to the newest published for the version (GPU only);
    ``python`` picks the slim image for torch on CPU (default: the newest listed).
    Raises UnsupportedImageError listing the valid combinations when upstream
    does not publish the one asked for, and ValueError for a bad device.
    """
    known_framework(framework)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {list(DEVICES)} (got {device!r})")
    if cuda and device != "gpu":
        raise ValueError(f"cuda: {cuda} needs device gpu (got device {device!r})")
    entry = load_table()["frameworks"][framework]
    version = base_version(version)
    flavours = entry["versions"].get(version)
    if flavours is None:
        raise _refuse(framework, f"{framework} {version}", published(framework))
    if mirror and not entry.get("mirror"):
        raise UnsupportedImageError(f"--mirror: no mirror of {entry['repository']} is known; drop --mirror")
    repository = entry["mirror"] if mirror else entry["repository"]
    common = dict(framework=framework, version=version, device=device, family=tuple(entry["family"]),
                  provided=tuple(entry["provided"]), provided_prefixes=tuple(entry["provided_prefixes"]))
    if device == "cpu":
        if not flavours.get("cpu"):
            raise _refuse(framework, f"{framework} {version} on cpu", published(framework))
        if "cpu_image" not in entry:
            return BaseImage(ref=f"{repository}:{flavours['cpu']}", python=entry["python"], **common)
        cpu = entry["cpu_image"]
        py = python or cpu["pythons"][-1]
        if py not in cpu["pythons"]:
            raise UnsupportedImageError(
                f"python {py}: no {cpu['repository']} slim image is listed for it; choose one of {', '.join(cpu['pythons'])}"
            )
        # the framework comes from pip, so only pip's own tooling is in the image
        return BaseImage(ref=f"{cpu['repository']}:{cpu['tag'].format(python=py)}", python=py,
                         pip_index=cpu["pip_index"], **{**common, "provided": ("pip", "setuptools", "wheel"),
                                                        "provided_prefixes": ()})
    gpu = flavours.get("gpu", {})
    if not gpu:
        raise _refuse(framework, f"{framework} {version} on gpu", published(framework))
    chosen = cuda or max(gpu, key=lambda c: tuple(int(p) for p in c.split(".")))
    if chosen not in gpu:
        raise _refuse(framework, f"{framework} {version} with CUDA {chosen}", published(framework))
    row = gpu[chosen]
    return BaseImage(ref=f"{repository}:{row['tag']}", cuda=chosen, cudnn=row["cudnn"], python=entry["python"],
                     **common)
