"""`hfleet env check`: can this machine train? Host facts, framework facts, a real all-reduce.

`check_environment` returns one JSON-ready dict; the CLI prints it as a table
or, with ``--json``, as this object:

- ``python``: ``{version, minor, implementation, executable}``
- ``os``: ``{system, release, machine, glibc}``
- ``hostname``: str
- ``cpu``: ``{model, logical_cores, physical_cores, usable_cores}``
- ``memory``: ``{total_bytes, available_bytes}``
- ``gpus``: ``{count, names, driver, source}`` from nvidia-smi
- ``frameworks``: ``{torch|paddle: {installed, version, cuda_compiled, cuda,
  cudnn, nccl, devices, backends: {gloo, nccl}, smoke}}``; ``smoke`` is null when
  skipped, else ``{ok, backend, world_size, value, duration_s, error}``; a
  framework that is not installed has ``installed: false`` and ``error``
- ``gpu_required``: bool, whether the caller demanded a visible GPU
- ``problems``: ``[{kind, message}]``, kind being an `hybridfleet.errors` kind
  (framework_missing, gpu_required, collective_smoke)
- ``ok``: true when ``problems`` is empty

`raise_for_problems` turns the first problem (in that order of kinds) into
its exception, so the CLI exits with that kind's code.
"""

from __future__ import annotations

from typing import Any, Iterable

from hybridfleet.env import host
from hybridfleet.env.probe import FRAMEWORKS, framework_installed, known_framework, probe_framework
from hybridfleet.env.smoke import SMOKE_TIMEOUT_S, choose_backend, run_smoke
from hybridfleet.errors import CollectiveSmokeError, FrameworkMissingError, GpuRequiredError, HfleetError

_PROBLEM_ORDER: list[type[HfleetError]] = [FrameworkMissingError, GpuRequiredError, CollectiveSmokeError]


def _framework_report(name: str, smoke: bool, timeout_s: float, problems: list[dict]) -> dict[str, Any]:
    try:
        facts = probe_framework(name)
    except FrameworkMissingError as err:
        return {"installed": False, "error": str(err), "smoke": None}
    report: dict[str, Any] = {"installed": True, **facts, "smoke": None}
    if smoke:
        backend = choose_backend(facts)
        try:
            report["smoke"] = {"ok": True, **run_smoke(name, backend, timeout_s=timeout_s), "error": None}
        except CollectiveSmokeError as err:
            report["smoke"] = {"ok": False, "backend": backend, "error": str(err)}
            problems.append({"kind": CollectiveSmokeError.kind, "message": str(err)})
    return report


def check_environment(
    frameworks: Iterable[str] | None = None,
    smoke: bool = True,
    *,
    gpus_required: int = 0,
    timeout_s: float = SMOKE_TIMEOUT_S,
) -> dict[str, Any]:
    """Check this machine; return the report described in the module docstring.

    ``frameworks``: names to check (default: every known one that is installed).
    A named framework that is missing is a problem; with no names, having neither
    is a problem. ``gpus_required`` > 0 makes "no GPU visible" a problem. Each smoke
    test is bounded by ``timeout_s`` (each probe by its own fixed bound). Raises ValueError for an unknown
    framework name or a non-positive timeout, before doing anything.
    """
    names = list(frameworks) if frameworks is not None else None
    for name in names or []:
        known_framework(name)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
    if gpus_required < 0:
        raise ValueError(f"gpus_required: must be >= 0 (got {gpus_required})")
    required = bool(names)
    to_check = names if names else sorted(FRAMEWORKS)
    problems: list[dict] = []
    report: dict[str, Any] = {
        "python": host.python_facts(),
        "os": host.platform_facts(),
        "hostname": host.hostname(),
        "cpu": host.cpu_facts(),
        "memory": host.memory_facts(),
        "gpus": host.nvidia_gpus(),
        "frameworks": {},
        "gpu_required": gpus_required > 0,
    }
    for name in to_check:
        if not framework_installed(name):
            report["frameworks"][name] = {"installed": False, "error": f"{name} is not installed", "smoke": None}
            if required:
                problems.append({"kind": FrameworkMissingError.kind,
                                 "message": f"{name} is not installed (needed: {_why(names)})"})
            continue
        entry = _framework_report(name, smoke, timeout_s, problems)
        report["frameworks"][name] = entry
        if not entry["installed"] and required:
            problems.append({"kind": FrameworkMissingError.kind, "message": entry["error"]})
    if not required and not any(f["installed"] for f in report["frameworks"].values()):
        problems.append({"kind": FrameworkMissingError.kind,
                         "message": f"no framework is installed (looked for {', '.join(to_check)})"})
    if gpus_required:
        visible = max([report["gpus"]["count"]] + [len(f.get("devices", [])) for f in report["frameworks"].values()])
        if visible < gpus_required:
            problems.append({"kind": GpuRequiredError.kind, "message": _gpu_message(report, gpus_required, visible)})
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _why(names: list[str] | None) -> str:
    return "named on the command line or by the job" if names else "any framework"


def _gpu_message(report: dict[str, Any], wanted: int, visible: int) -> str:
    seen = [f"nvidia-smi: {report['gpus']['source'] if not report['gpus']['count'] else report['gpus']['count']}"]
    for name, facts in report["frameworks"].items():
        if facts.get("installed"):
            seen.append(f"{name}: {len(facts.get('devices', []))} CUDA device(s)")
    return f"the job asks for {wanted} GPU(s) but {visible} is visible ({'; '.join(seen)})"


def raise_for_problems(report: dict[str, Any]) -> None:
    """Raise the exception of the report's most fundamental problem; return if there is none."""
    for cls in _PROBLEM_ORDER:
        messages = [p["message"] for p in report.get("problems", []) if p["kind"] == cls.kind]
        if messages:
            raise cls("; ".join(messages))
