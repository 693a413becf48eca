"""Which locked distributions an image needs at run time.

A lock records everything installed on the machine it was made on, test tools included.
An image needs the closure of what the job runs, walked through the installed
distributions' metadata with the markers evaluated for the image's Python:

- hybridfleet's own requirements, with `RUNTIME_EXTRAS` and the extras the job's blocks
  need (`job_extras`: the registry client for a ``registry:`` block, the report);
- the job's framework (its own dependencies: filelock, sympy, networkx, jinja2 for torch);
- every distribution the job's training script imports (`script_distributions`), through
  the local modules beside it that it imports.

What is left out is classified from hybridfleet's own metadata: a distribution of the
``dev`` extra is a test or development tool; anything else is imported by nothing the job runs.
"""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from hybridfleet.env.lock import normalize_name

PROJECT = "hybridfleet"
# remote checkpoint stores, packed site datasets, differential privacy, the shipped examples' data
RUNTIME_EXTRAS = ("s3", "data", "privacy", "examples")
DEV_EXTRA = "dev"
# the distribution of each framework the job's image runs
FRAMEWORK_DISTRIBUTIONS = {"torch": "torch", "paddle": "paddlepaddle"}


def _marker_env(python: str, extra: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "extra": extra}


def _applies(req: Requirement, python: str, extras: tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(_marker_env(python, extra)) for extra in ("", *extras))


def _requires(name: str) -> list[str] | None:
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return None


def closure(roots: list[tuple[Requirement, tuple[str, ...]]], python: str) -> dict[str, str]:
    """``{normalized name: specifier}`` of ``roots`` and everything they require on ``python``."""
    found: dict[str, str] = {}
    queue = list(roots)
    while queue:
        req, wanted = queue.pop()
        if not _applies(req, python, wanted):
            continue
        name = normalize_name(req.name)
        if name in found:
            continue
        found[name] = str(req.specifier)
        children = _requires(name)
        if children is None:
            continue  # not installed here: pip resolves it in the image
        queue += [(Requirement(text), tuple(req.extras)) for text in children]
    return found


def runtime_closure(python: str, extras: tuple[str, ...] = RUNTIME_EXTRAS,
                    distributions: tuple[str, ...] = ()) -> dict[str, str] | None:
    """``{normalized name: specifier}`` of every distribution the image needs at run time on ``python``:
    hybridfleet with ``extras``, plus ``distributions`` (the framework, the script's imports) and
    their requirements. None when hybridfleet's metadata is not installed (nothing to walk from)."""
    roots = _requires(PROJECT)
    if roots is None:
        return None
    queue = [(Requirement(text), extras) for text in roots]
    queue += [(Requirement(name), ()) for name in distributions]
    return closure(queue, python)


def dev_tools(python: str) -> set[str]:
    """The distributions hybridfleet's ``dev`` extra names (test and development tools), as named."""
    roots = _requires(PROJECT) or []
    out = set()
    for text in roots:
        req = Requirement(text)
        if req.marker is not None and req.marker.evaluate(_marker_env(python, DEV_EXTRA)) \
                and not req.marker.evaluate(_marker_env(python, "")):
            out.add(normalize_name(req.name))
    return out


def job_extras(spec: Any) -> tuple[str, ...]:
    """hybridfleet's extras the job's blocks need at run time, beyond `RUNTIME_EXTRAS`."""
    extras = ["report"]  # `hfleet run` writes report.html at the end of every run
    if spec.registry.publish_as:
        extras.append("registry")  # the registry client (httpx for a remote registry)
    return tuple(extras)


def imported_modules(script: Path, _seen: set[Path] | None = None) -> set[str]:
    """Top-level modules ``script`` imports when it runs (imports inside functions are lazy and left
    out), through the local modules beside it that it imports."""
    seen = _seen if _seen is not None else set()
    if script in seen or not script.is_file():
        return set()
    seen.add(script)
    tree = ast.parse(script.read_text(encoding="utf-8", errors="replace"), filename=str(script))
    names: set[str] = set()
    for node in _run_at_import(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    out: set[str] = set()
    for name in names:
        local = script.parent / f"{name}.py"
        if local.is_file():
            out |= imported_modules(local, seen)
        else:
            out.add(name)
    return out


def _run_at_import(tree: ast.AST):
    """The nodes executed when the module runs: not the bodies of functions (their imports are lazy,
    e.g. the other framework's model builder beside this one's)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [child for child in ast.iter_child_nodes(node)
                 if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def script_distributions(script: Path) -> tuple[str, ...]:
    """The installed distributions that provide the modules ``script`` imports (standard library and
    modules installed here by no distribution left out)."""
    by_module = importlib.metadata.packages_distributions()
    dists = {normalize_name(d) for m in imported_modules(script) for d in by_module.get(m, [])}
    return tuple(sorted(dists))
