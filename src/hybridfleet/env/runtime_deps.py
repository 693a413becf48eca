"""Which locked distributions an image needs at run time.

A lock records everything installed on the machine it was made on, test tools included.
An image needs only the closure of hybridfleet's own requirements (plus `RUNTIME_EXTRAS`),
walked through the installed distributions' metadata with the markers evaluated for the
image's Python.
"""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement

from hybridfleet.env.lock import normalize_name

PROJECT = "hybridfleet"
# remote checkpoint stores, packed site datasets, differential privacy, the shipped examples' data
RUNTIME_EXTRAS = ("s3", "data", "privacy", "examples")


def _marker_env(python: str, extra: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "extra": extra}


def _applies(req: Requirement, python: str, extras: tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(_marker_env(python, extra)) for extra in ("", *extras))


def runtime_closure(python: str, extras: tuple[str, ...] = RUNTIME_EXTRAS) -> dict[str, str] | None:
    """``{normalized name: specifier}`` of every distribution hybridfleet needs at run time on ``python``.

    None when hybridfleet's metadata is not installed (nothing to walk from).
    """
    try:
        roots = importlib.metadata.requires(PROJECT) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found: dict[str, str] = {}
    queue = [(Requirement(text), extras) for text in roots]
    while queue:
        req, wanted = queue.pop()
        if not _applies(req, python, wanted):
            continue
        name = normalize_name(req.name)
        if name in found:
            continue
        found[name] = str(req.specifier)
        try:
            children = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: pip resolves it in the image
        queue += [(Requirement(text), tuple(req.extras)) for text in children]
    return found
