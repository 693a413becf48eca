"""Where a version's metrics come from, and which of them a promotion gate may take as evidence.

Every metric of a version carries a provenance record (``versions.metric_sources``):

- ``{"source": "checkpoint", "origin": "manifest" | "MODEL.json"}``: the checkpoint's own
  record, written by the run that saved it (its manifest, or the run's model card);
- ``{"source": "claimed", "by": PRINCIPAL}``: sent by the writer with the registration
  (``publish --metric`` / REST ``metrics``); nothing checked it;
- ``{"source": "measured", "by": PRINCIPAL, "at_s": T, "script": NAME, "script_sha256": HEX,
  "manifest_sha256": HEX}``: measured by ``promote --evaluate SCRIPT`` on the stored weights.

A gate takes checkpoint and measured figures; a claimed one (or one without a record, as
versions registered before provenance existed) only with ``trust_claimed``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from hybridfleet.errors import RegistryError

CHECKPOINT, CLAIMED, MEASURED = "checkpoint", "claimed", "measured"
EVIDENCE = (CHECKPOINT, MEASURED)


def finite_metrics(metrics: dict[str, Any] | None, what: str, outcome: str = "nothing registered") -> dict[str, float]:
    """``metrics`` as ``{name: float}``; RegistryError naming the first value that is not a finite number."""
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{what}: metric names must be non-empty strings (got {name!r}); {outcome}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RegistryError(f"{what}: metric {name!r} must be a number (got {value!r}); {outcome}")
        if not math.isfinite(float(value)):
            raise RegistryError(f"{what}: metric {name!r} is {value!r}; metrics must be finite numbers "
                                f"(NaN and Infinity pass or fail every gate by accident); {outcome}")
        out[name] = float(value)
    return out


def combine(own: dict[str, float], own_sources: dict[str, dict], claimed: dict[str, float],
            actor: str) -> tuple[dict[str, float], dict[str, dict]]:  # fmt: skip
    """(metrics, sources) of a new version from the checkpoint's own figures and a writer's claims.

    A claim never replaces the checkpoint's own figure: a different value for the same
    metric is refused (RegistryError), the same value stays the checkpoint's.
    """
    metrics, sources = dict(own), dict(own_sources)
    for name, value in claimed.items():
        if name in own:
            if own[name] != value:
                raise RegistryError(f"metric {name!r}: the checkpoint records {own[name]:g}; a claim of {value:g} "
                                    f"cannot replace it; nothing registered")
            continue
        metrics[name] = value
        sources[name] = {"source": CLAIMED, "by": actor}
    return metrics, sources


def source_of(sources: dict[str, Any] | None, metric: str) -> str:
    """The source of ``metric`` (``claimed`` when nothing is recorded)."""
    record = (sources or {}).get(metric)
    return str(record.get("source", CLAIMED)) if isinstance(record, dict) else CLAIMED


@dataclass
class Measurement:
    """Metrics an evaluation script measured on one version's stored weights."""

    metrics: dict[str, float]
    script: str               # the script's file name
    script_sha256: str        # of the exact bytes that ran
    manifest_sha256: str      # the version's manifest: which weights were measured
    at_s: float
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """A measurement sent by a client; RegistryError for a missing field or a non-finite metric."""
        try:
            out = cls(metrics=finite_metrics(data["metrics"], "measurement", "nothing recorded"), script=str(data["script"]),
                      script_sha256=str(data["script_sha256"]), manifest_sha256=str(data["manifest_sha256"]),
                      at_s=float(data.get("at_s") or time.time()), wall_s=float(data.get("wall_s") or 0.0))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RegistryError(f"measurement: expected metrics, script, script_sha256, manifest_sha256 ({err})") from None
        if not out.metrics:
            raise RegistryError("measurement: the evaluation reported no metrics")
        return out

    def sources(self, actor: str) -> dict[str, dict]:
        """The provenance record of each measured metric, measured by ``actor``."""
        record = {"source": MEASURED, "by": actor, "at_s": self.at_s, "script": self.script,
                  "script_sha256": self.script_sha256, "manifest_sha256": self.manifest_sha256}  # fmt: skip
        return {name: dict(record) for name in self.metrics}
