"""Compare runs in `hfleet ui`: the joint model's metric of each run overlaid on one plot (the test
accuracy when any run reports one, else the first other metric they report, e.g. bits per character), and the job
each run recorded side by side: its copy of the resolved job (``job.json``, secrets redacted; older runs: ``run.json``
and the summary's job settings).

The plot is drawn here with matplotlib into a PNG served by the UI itself (the page has no
script); the spec table marks every row whose values differ between the runs.
"""

from __future__ import annotations

import json
from typing import Any

from hybridfleet.obs.metric_direction import lower_is_better
from hybridfleet.obs.metric_plots import ACCURACY_SECTION, joint_series, metric_label, reported_sections
from hybridfleet.obs.report import render_plot
from hybridfleet.obs.runinfo import RunData

MAX_RUNS = 8
# summary.json fields that describe how the job was set up (not what it measured)
_SUMMARY_SETUP = ("framework", "sync", "shards", "workers", "train_rows", "resumed_from")


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value}


def spec_of(run: RunData) -> dict[str, str]:
    """The job settings the run recorded, flattened to ``dotted.key -> text``: its copy of the resolved job
    (``job.json``) and the run it resumed; a run made before runs kept that copy: ``run.json`` and the summary's
    job settings."""
    if run.job_spec:
        spec = _flatten(run.job_spec)
        spec["resumed_from"] = _flatten(run.info.get("resumed_from"))[""]
        return spec
    spec = _flatten(run.info)
    summary = run.summary if isinstance(run.summary, dict) else {}
    for key in _SUMMARY_SETUP:
        if key in summary and key not in spec:
            spec.update(_flatten(summary[key], key))
    return spec


def spec_diff(runs: list[RunData]) -> list[dict[str, Any]]:
    """One row per setting any run recorded: the value in each run (``-`` where absent) and whether they differ."""
    specs = [spec_of(r) for r in runs]
    keys = sorted(set().union(*specs)) if specs else []
    rows = []
    for key in keys:
        values = [s.get(key, "-") for s in specs]
        rows.append({"key": key, "cells": values, "differs": len(set(values)) > 1})
    return rows


def compared_metric(runs: list[RunData]) -> str:
    """The metric the compare plot overlays: the accuracy when any run reports one, else the first metric
    other than the training loss that any run reports (by name), else the training loss."""
    reported = {key for run in runs for key in reported_sections(run)}
    if ACCURACY_SECTION in reported or not reported:
        return ACCURACY_SECTION
    others = sorted(reported - {"loss"})
    return others[0] if others else "loss"


def accuracy_png(runs: list[tuple[str, RunData]]) -> bytes:
    """One PNG: each run's joint model metric (`compared_metric`) against worker step (from its metrics.jsonl)."""
    metric = compared_metric([run for _, run in runs])

    def draw(ax, _run) -> bool:
        for run_id, run in runs:
            points = joint_series(run, metric)
            if points:
                ax.plot(*zip(*points), marker=".", label=run_id.replace("$", r"\$"))
        better = "lower" if lower_is_better(metric) else "higher"
        ax.set(xlabel="worker step", ylabel=f"joint {metric_label(metric, runs[0][1])}\n({better} is better)")
        if not ax.get_legend_handles_labels()[0]:
            ax.text(0.5, 0.5, "no run reported a test accuracy yet", ha="center", va="center",
                    transform=ax.transAxes)  # fmt: skip
        return True

    png = render_plot(draw, runs[0][1])
    assert png is not None  # draw always returns True
    return png
