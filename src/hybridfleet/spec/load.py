"""Loading job files and turning validation failures into messages a user can act on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridfleet.errors import SpecError
from hybridfleet.spec.models import JobSpec

_FIXES = {
    "extra_forbidden": "remove it (unknown key) or check its spelling",
    "missing": "add this required field",
    "literal_error": "use one of the allowed values",
}


def _path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def format_errors(err: ValidationError) -> list[str]:
    """One line per problem: ``field.path: what is wrong (got value); fix``."""
    lines = []
    for e in err.errors():
        path = _path(tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))))
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = e.get("input")
        fix = _FIXES.get(e["type"], "")
        if e["type"] == "missing":
            lines.append(f"{path}: required field is missing; {fix}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key (got {got!r}); {fix}")
        elif isinstance(got, dict) and e["type"] in ("value_error", "assertion_error"):
            # model-level checks name their own field: "nesterov: needs ..."
            prefix = "" if path == "(top level)" else path + "."
            lines.append(f"{prefix}{msg}" if ":" in msg.split(" ")[0] else f"{path}: {msg}")
        else:
            line = f"{path}: {msg[0].lower() + msg[1:] if msg else msg} (got {got!r})"
            lines.append(f"{line}; {fix}" if fix else line)
    return lines


def parse_spec(data: Any, source: str = "<job>") -> JobSpec:
    """Validate a mapping as a job spec; raise `SpecError` listing every problem."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a job file is a YAML mapping (got {type(data).__name__})",
                        hint="pass the job file (name, framework, entrypoint, mode, sites ...); see examples/*.yaml")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        lines = format_errors(err)
        raise SpecError(f"{source}: {len(lines)} problem(s)\n" + "\n".join(f"  {l}" for l in lines)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job file."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: no such job file",
                        hint=f"check the path (relative paths start at {Path.cwd()}); the shipped examples are in examples/")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"{p}: not valid YAML: {err}", hint="fix the YAML syntax at the line and column above") from None
    return parse_spec(data, str(p))
