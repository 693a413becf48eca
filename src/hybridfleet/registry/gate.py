"""Promotion gates: ``METRIC OP NUMBER`` requirements and "no regression against an alias".

``test_accuracy>=0.95``, ``val_loss<0.3``, ``f1 == 1``. The operator also says which
direction is better (``>``/``>=``: higher; ``<``/``<=``: lower), which is what the
no-regression check uses: the candidate may be worse than the alias's version by at
most ``tolerance``.

A gate judges evidence, not claims: a metric the writer merely sent with the
registration (or one without a recorded source) fails its check unless the caller
trusts claims (see `hybridfleet.registry.evidence`); a non-finite value fails always.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import asdict, dataclass

from hybridfleet.errors import RegistryError
from hybridfleet.registry.evidence import EVIDENCE, source_of

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
_EXPR = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.\-/]*)\s*(>=|<=|==|>|<)\s*([-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?)\s*")


@dataclass(frozen=True)
class Requirement:
    metric: str
    op: str
    threshold: float

    @property
    def higher_is_better(self) -> bool:
        return self.op in (">", ">=", "==")

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


def parse_requirement(text: str) -> Requirement:
    """Parse ``METRIC OP NUMBER``; RegistryError naming the expression and the grammar otherwise."""
    match = _EXPR.fullmatch(text or "")
    if not match:
        raise RegistryError(f"gate expression {text!r} does not parse; expected METRIC OP NUMBER with OP one of "
                            f"{', '.join(_OPS)} (e.g. 'test_accuracy>=0.95')")
    return Requirement(match.group(1), match.group(2), float(match.group(3)))


@dataclass
class Check:
    """One gate check and its outcome (the machine-readable reason of `promote --json`)."""

    check: str          # "require" or "no_regression"
    metric: str
    passed: bool
    value: float | None
    threshold: float | None
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _unusable(value: float, source: str, trust_claimed: bool, whose: str, metric: str) -> str | None:
    """Why ``value`` cannot be judged (None: it can)."""
    if not math.isfinite(value):
        return f"{whose} {metric}={value!r} is not a finite number"
    if source not in EVIDENCE and not trust_claimed:
        return (f"{whose} {metric}={value:g} is {source}, not evidence: the checkpoint does not record it and no "
                f"gate measured it (measure it with --evaluate SCRIPT, or pass --trust-claimed)")
    return None


def evaluate(metrics: dict[str, float], requirements: list[Requirement], baseline: dict[str, float] | None = None,
             baseline_name: str = "", tolerance: float = 0.0, sources: dict[str, dict] | None = None,
             baseline_sources: dict[str, dict] | None = None, trust_claimed: bool = False) -> list[Check]:  # fmt: skip
    """Every requirement against ``metrics``, then (with a ``baseline``) no regression on the same metrics.

    A metric the version lacks fails its check (never passes silently), as does a claimed
    one (``sources`` says which are) unless ``trust_claimed``, and a non-finite one.
    """
    if tolerance < 0 or not math.isfinite(tolerance):
        raise RegistryError(f"--tolerance must be a finite number >= 0 (got {tolerance})")
    checks = []
    for req in requirements:
        value = metrics.get(req.metric)
        if value is None:
            checks.append(Check("require", req.metric, False, None, req.threshold,
                                f"the version has no metric {req.metric!r} (it has: {', '.join(sorted(metrics)) or 'none'})"))
            continue
        refusal = _unusable(value, source_of(sources, req.metric), trust_claimed, "the version's", req.metric)
        if refusal:
            checks.append(Check("require", req.metric, False, value, req.threshold, refusal))
            continue
        ok = _OPS[req.op](value, req.threshold)
        checks.append(Check("require", req.metric, ok, value, req.threshold,
                            f"{req.metric}={value:g} {'meets' if ok else 'fails'} {req} ({source_of(sources, req.metric)})"))
    if baseline is not None:
        for req in requirements:
            value, base = metrics.get(req.metric), baseline.get(req.metric)
            if value is None:
                continue  # already failed above
            if base is None:
                checks.append(Check("no_regression", req.metric, True, value, None,
                                    f"{baseline_name} has no {req.metric}; nothing to regress from"))
                continue
            refusal = _unusable(base, source_of(baseline_sources, req.metric), trust_claimed, baseline_name, req.metric)
            if refusal:
                checks.append(Check("no_regression", req.metric, False, value, None, refusal))
                continue
            floor = base - tolerance if req.higher_is_better else base + tolerance
            ok = value >= floor if req.higher_is_better else value <= floor
            checks.append(Check("no_regression", req.metric, ok, value, floor,
                                f"{req.metric}={value:g} vs {baseline_name} {base:g} (tolerance {tolerance:g}): "
                                f"{'no regression' if ok else 'regression'}"))
    return checks
