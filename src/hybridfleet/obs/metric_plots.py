"""The metrics a run's scripts report, and one plot per metric: the joint model, each site, each site alone.

A script reports whatever it measures (``ps.report(loss=..., test_accuracy=...)`` for a
classifier, ``test_bpc`` for a character model); the report and the UI draw one plot for
each metric key found in the run's ``metrics.jsonl`` whose name says which way is better
(`hybridfleet.obs.metric_direction`: ``test_accuracy``, ``val_f1`` higher; ``loss``, ``test_bpc`` lower).

Other numbers in a record (steps, bytes, seconds, privacy budgets) are bookkeeping, not
plotted here. Each plot shows the joint model (the mean over every worker at a step), one
curve per site where the sites' workers report different values (training loss on their
own rows), and each site trained alone (the ``baseline-<site>`` processes that
``train.site_baselines`` starts), dashed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

from hybridfleet.obs.metric_direction import lower_is_better
from hybridfleet.obs.runinfo import RunData

ACCURACY_KEYS = ("test_accuracy", "val_accuracy", "accuracy")
ACCURACY_SECTION = "accuracy"  # the accuracy family shares one plot (and its historic URL)
DEFAULT_METRICS = ("loss", ACCURACY_SECTION)  # plotted (as "no data") for a run that reported no metric yet
LABELS = {"loss": "training loss", "test_bpc": "held-out bits per character", "val_bpc": "validation bits per character",
          "test_accuracy": "test accuracy", "val_accuracy": "validation accuracy", "accuracy": "accuracy",
          "test_loss": "test loss", "val_loss": "validation loss", "test_perplexity": "test perplexity"}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,63}$")


def is_metric_key(key: str) -> bool:
    """Whether ``key`` names a plottable metric (or is the accuracy family's section)."""
    return isinstance(key, str) and bool(_NAME.match(key)) and lower_is_better(key) is not None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _workers(run: RunData) -> list[dict]:
    return [r for r in run.metrics if str(r.get("process", "")).startswith("worker-")]


def _baselines(run: RunData) -> list[dict]:
    return [r for r in run.metrics if str(r.get("process", "")).startswith("baseline-")]


def _value_of(section: str) -> Callable[[dict], float | None]:
    if section != ACCURACY_SECTION:
        return lambda rec: _number(rec.get(section))

    def first_accuracy(rec: dict) -> float | None:
        for key in ACCURACY_KEYS:
            if _number(rec.get(key)) is not None:
                return _number(rec[key])
        return None

    return first_accuracy


def by_site_step(records: list[dict], value: Callable[[dict], float | None]) -> dict[str, list[tuple[int, float]]]:
    """site -> [(step, mean over the site's records at that step)] sorted by step (records without a value or an
    integer step are left out)."""
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        v = value(r)
        step = r.get("step")
        if v is None or not isinstance(step, int) or isinstance(step, bool):
            continue
        acc[str(r.get("site", "?"))][step].append(v)
    return {site: sorted((s, sum(vs) / len(vs)) for s, vs in steps.items()) for site, steps in sorted(acc.items())}


def reported_sections(run: RunData) -> list[str]:
    """The metric sections of ``run``: ``loss`` first, then ``accuracy`` (any of ACCURACY_KEYS), then every other
    metric its workers or site baselines reported, by name."""
    keys: set[str] = set()
    for rec in _workers(run) + _baselines(run):
        for key, value in rec.items():
            if _number(value) is not None and is_metric_key(key):
                keys.add(ACCURACY_SECTION if key in ACCURACY_KEYS else key)
    first = [k for k in ("loss", ACCURACY_SECTION) if k in keys]
    return first + sorted(keys - set(first))


def metric_label(section: str, run: RunData | None = None) -> str:
    """What the plot of ``section`` shows, e.g. ``held-out bits per character (test_bpc)``."""
    key = section
    if section == ACCURACY_SECTION and run is not None:
        found = [k for k in ACCURACY_KEYS if any(_number(r.get(k)) is not None for r in run.metrics)]
        key = found[0] if found else "test_accuracy"
    elif section == ACCURACY_SECTION:
        key = "test_accuracy"
    label = LABELS.get(key, key.replace("_", " "))
    return label if label.replace(" ", "_") == key else f"{label} ({key})"


def section_title(section: str) -> str:
    """The heading of a metric's plot, saying which way is better."""
    better = "lower is better" if lower_is_better(section) else "higher is better"
    key = "test_accuracy" if section == ACCURACY_SECTION else section
    name = LABELS.get(key, key.replace("_", " "))
    return f"{name[0].upper()}{name[1:]} ({better}): joint model, each site, each site alone"


def joint_series(run: RunData, section: str) -> list[tuple[int, float]]:
    """The joint model's ``section`` metric against worker step: at each step the mean over the workers that
    reported it (one model, all sites); empty when none did."""
    return by_site_step([{**r, "site": "joint"} for r in _workers(run)], _value_of(section)).get("joint", [])


def _sites_differ(per_site: dict[str, list[tuple[int, float]]]) -> bool:
    if len(per_site) < 2:
        return False
    curves = list(per_site.values())
    return any(dict(c) != dict(curves[0]) for c in curves[1:])


def draw_metric(section: str) -> Callable:
    """``draw(ax, run)`` for the plot of metric ``section``; it returns False when the run has no such values."""

    def draw(ax, run: RunData) -> bool:
        value = _value_of(section)
        joint = joint_series(run, section)
        per_site = by_site_step(_workers(run), value)
        alone = by_site_step(_baselines(run), value)
        if joint:
            label = "mean over the sites' workers" if _sites_differ(per_site) else "joint model (all sites)"
            ax.plot(*zip(*joint), marker=".", linewidth=2, color="black", label=label)
        if _sites_differ(per_site):
            for site, points in per_site.items():
                ax.plot(*zip(*points), marker=".", linewidth=1, label=f"workers at {site}")
        for site, points in alone.items():
            ax.plot(*zip(*points), linestyle="--", marker=".", label=f"{site} alone")
        lower = lower_is_better(section)
        ax.set(xlabel="worker step", ylabel=f"{metric_label(section, run)}\n({'lower' if lower else 'higher'} is better)")
        return bool(joint or alone)

    return draw


def final_values(run: RunData, section: str) -> tuple[float | None, dict[str, float]]:
    """Metric ``section`` of the joint model (global rank 0's final report, else its last) and of each site
    alone (each baseline's final report, else its last); None / absent where nothing was reported."""
    value = _value_of(section)

    def last(records: list[dict]) -> float | None:
        finals = [r for r in records if r.get("final") is True and value(r) is not None]
        others = [r for r in records if value(r) is not None]
        pick = finals or others
        return value(pick[-1]) if pick else None

    workers = _workers(run)
    joint = last([r for r in workers if r.get("rank") == 0])
    if joint is None:
        joint = last(workers)
    by_site: dict[str, list[dict]] = defaultdict(list)
    for rec in _baselines(run):
        by_site[str(rec.get("site", rec.get("process", "?")))].append(rec)
    alone = {site: v for site, recs in sorted(by_site.items()) if (v := last(recs)) is not None}
    return joint, alone
