"""`hfleet env diff A B`: every difference between two locks, with a severity.

- error: framework versions, their CUDA and cuDNN, the Python minor version
- warning: other distributions added, removed or changed; the Python patch level
- info: host facts (hostname, CPU), platform (OS, kernel, machine, glibc),
  GPU driver and image reference

Error-level drift is what breaks "it worked on my machine"; CI gates on it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybridfleet.env.probe import FRAMEWORKS

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Difference:
    """One difference: where (dotted path), how serious, the two values and a sentence."""

    path: str
    severity: str
    a: Any
    b: Any
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _framework_distributions() -> set[str]:
    return {d for spec in FRAMEWORKS.values() for d in spec["distributions"]}


def _compare(out: list[Difference], path: str, a: Any, b: Any, severity: str, what: str) -> None:
    if a != b:
        if a is None:
            message = f"{what} only in B ({b})"
        elif b is None:
            message = f"{what} only in A ({a})"
        else:
            message = f"{what} differs: {a} -> {b}"
        out.append(Difference(path, severity, a, b, message))


def diff_locks(a: dict[str, Any], b: dict[str, Any]) -> list[Difference]:
    """The differences from lock ``a`` to lock ``b``, errors first, then warnings, then info."""
    out: list[Difference] = []
    pa, pb = a.get("python", {}), b.get("python", {})
    _compare(out, "python.minor", pa.get("minor"), pb.get("minor"), "error", "Python minor version")
    if pa.get("minor") == pb.get("minor"):
        _compare(out, "python.version", pa.get("version"), pb.get("version"), "warning", "Python patch version")
    fa, fb = a.get("frameworks", {}), b.get("frameworks", {})
    for name in sorted(set(fa) | set(fb)):
        if name not in fa or name not in fb:
            side = "B" if name in fb else "A"
            version = (fb if name in fb else fa)[name].get("version")
            out.append(Difference(f"frameworks.{name}", "error", fa.get(name, {}).get("version"),
                                  fb.get(name, {}).get("version"), f"{name} {version} is installed only in {side}"))
            continue
        for key, label in (("version", "version"), ("cuda", "CUDA"), ("cudnn", "cuDNN")):
            _compare(out, f"frameworks.{name}.{key}", fa[name].get(key), fb[name].get(key), "error",
                     f"{name} {label}")
    skip = _framework_distributions()  # reported above as framework versions
    da, db = a.get("distributions", {}), b.get("distributions", {})
    for name in sorted((set(da) | set(db)) - skip):
        _compare(out, f"distributions.{name}", da.get(name), db.get(name), "warning", f"package {name}")
    for section, keys in (("host", ("hostname", "cpu_model", "cpu_count")),
                          ("platform", ("system", "release", "machine", "glibc"))):
        sa, sb = a.get(section) or {}, b.get(section) or {}
        for key in keys:
            _compare(out, f"{section}.{key}", sa.get(key), sb.get(key), "info", f"{section} {key}")
    _compare(out, "gpu_driver", a.get("gpu_driver"), b.get("gpu_driver"), "info", "GPU driver")
    ia, ib = (a.get("image") or {}).get("ref"), (b.get("image") or {}).get("ref")
    _compare(out, "image", ia, ib, "info", "image")
    return sorted(out, key=lambda d: SEVERITIES.index(d.severity))


def summarize(differences: list[Difference]) -> dict[str, int]:
    """How many differences of each severity."""
    return {s: sum(d.severity == s for d in differences) for s in SEVERITIES}
