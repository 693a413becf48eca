"""What a job file promises that this machine can check before anything starts.

`hfleet spec check` and `hfleet run` call `check_here`: every local entrypoint exists and
imports the framework its site trains with, every local site dataset exists and opens, and
the extras a block needs are installed. A mistake is one `SpecError` naming the field path
and the fix, before a single process starts; nothing here changes any file.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from hybridfleet.errors import HfleetError, SpecError
from hybridfleet.spec.models import JobSpec

# ``digits:site-a``: a named split that the training script itself resolves
_NAMED_SPLIT = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*:[^/\\]+$")
# the modules whose import shows which framework a script trains with
_FRAMEWORK_MODULES = {"torch": ("torch", "hybridfleet.torch"), "paddle": ("paddle", "hybridfleet.paddle")}
# the script beside an example's entrypoint that packs its site datasets
PACK_SCRIPT = "pack_sites.py"
# module a block needs -> (the block's field path, the extra that installs it)
_BLOCK_NEEDS = {"privacy": ("dp_accounting", "ps.privacy", "privacy")}


def check_here(spec: JobSpec, sites: list[str] | None = None, data: bool = True) -> None:
    """Refuse, with one `SpecError`, what this machine can tell is wrong with ``spec``.

    ``sites``: the sites whose entrypoints and data live here (default: every site);
    ``data``: also open every local site dataset.
    """
    names = list(spec.sites) if sites is None else sites
    for site in names:
        if site not in spec.sites:
            raise SpecError(f"--site {site}: not a site of job {spec.name} (sites: {', '.join(spec.sites)})",
                            hint="name one of the job's sites")
    for site in names:
        _check_entrypoint(spec, site)
    if data:
        for site in names:
            _check_data(spec, site)
    _check_blocks(spec)


def imported_frameworks(script: Path) -> set[str]:
    """The frameworks ``script`` imports (``torch``, ``paddle`` or both), read from its source."""
    tree = ast.parse(script.read_text(encoding="utf-8", errors="replace"), filename=str(script))
    modules: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
            modules += [f"{node.module}.{a.name}" for a in node.names]
    return {fw for fw, roots in _FRAMEWORK_MODULES.items()
            if any(m == r or m.startswith(r + ".") for m in modules for r in roots)}


def _check_entrypoint(spec: JobSpec, site: str) -> None:
    field = f"sites.{site}.entrypoint" if spec.sites[site].entrypoint else "entrypoint"
    entry = Path(spec.site_entrypoint(site))
    if not entry.is_file():
        raise SpecError(f"{field}: {str(entry)!r} is not a file (relative paths start at {Path.cwd()})",
                        hint=f"fix {field} in the job file, or run the command from the folder it is relative to")
    framework = spec.sites[site].framework or spec.framework
    try:
        found = imported_frameworks(entry)
    except SyntaxError as err:
        raise SpecError(f"{field}: {entry} is not valid Python (line {err.lineno}: {err.msg})",
                        hint=f"fix the script, or point {field} at the training script") from None
    if found and framework not in found:
        where = f"sites.{site}.framework" if spec.sites[site].framework else "framework"
        other = ", ".join(sorted(found))
        raise SpecError(f"{field}: {entry} trains with {other}, but {where} is {framework}",
                        hint=f"set {where}: {other}, or point {field} at the {framework} script")


def _check_data(spec: JobSpec, site: str) -> None:
    data = spec.sites[site].data
    if not data or "://" in data or _NAMED_SPLIT.match(data):
        return  # no data, a remote URL (read by the site's workers) or a split the script names
    path = Path(data)
    field = f"sites.{site}.data"
    if not path.exists():
        raise SpecError(f"{field}: {data!r} does not exist (relative paths start at {Path.cwd()})",
                        hint=_missing_data_hint(spec, site, field))
    if path.is_dir() and (path / "manifest.json").is_file():
        try:
            from hybridfleet.data import open_dataset

            open_dataset(str(path), verify=False)
        except ImportError as err:
            raise SpecError(f"{field}: reading packed datasets needs pyarrow ({err})",
                            hint="pip install 'hybridfleet[data]'") from None
        except (OSError, ValueError, HfleetError) as err:
            raise SpecError(f"{field}: {data!r} does not open as a packed dataset: {err}",
                            hint=f"`hfleet data verify {data}` says what is wrong; repack it with `hfleet data pack`") \
                from None


def _missing_data_hint(spec: JobSpec, site: str, field: str) -> str:
    """What to do about a missing site dataset: run the packing script beside the entrypoint when there is one
    (the shipped examples write their site datasets with ``pack_sites.py``), else fix the path."""
    packer = Path(spec.site_entrypoint(site)).parent / PACK_SCRIPT
    if packer.is_file():
        return (f"pack the site datasets first: python {packer} (it writes them with `hfleet data pack`); "
                f"or fix {field} in the job file")
    return (f"fix {field} in the job file (`hfleet data ls DIR` lists packed datasets), or run "
            "from the folder it is relative to")


def _check_blocks(spec: JobSpec) -> None:
    for attr, (module, field, extra) in _BLOCK_NEEDS.items():
        if getattr(spec.ps, attr, None) is not None and importlib.util.find_spec(module) is None:
            raise SpecError(f"{field}: needs the Python package {module!r}, which is not installed here",
                            hint=f"pip install 'hybridfleet[{extra}]'")
