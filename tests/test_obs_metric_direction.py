"""One rule says which way a metric is better (`hybridfleet.obs.metric_direction`); the plots, the UI
and the WAN and zoo benches all take their direction, "reached" and "worse" from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridfleet.obs import metric_direction, metric_plots
from hybridfleet.obs.metric_direction import higher_is_better, reached, worse_by

REPO = Path(__file__).resolve().parents[1]


def test_reached_and_worse_follow_the_metric_name():
    assert higher_is_better("test_accuracy") and not higher_is_better("test_bpc")
    assert reached("test_bpc", 1.9, 2.0) and not reached("test_bpc", 2.1, 2.0) and not reached("test_bpc", None, 2.0)
    assert reached("test_accuracy", 0.90, 0.90) and not reached("test_accuracy", 0.89, 0.90)
    assert worse_by("test_bpc", 1.50, 1.53) == pytest.approx(0.03)
    assert worse_by("test_accuracy", 0.92, 0.90) == pytest.approx(0.02)


def test_a_name_that_says_no_direction_is_refused_with_the_words_that_would():
    with pytest.raises(ValueError, match=r"metric 'elapsed_s': its name says neither .*'accuracy'.*'bpc'"):
        higher_is_better("elapsed_s")
    with pytest.raises(ValueError, match="neither higher nor lower"):
        reached("rounds", 3.0, 2.0)


def test_plots_and_both_benches_use_the_same_rule():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import _wan_workloads
        import _zoo_workloads
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert metric_plots.lower_is_better is metric_direction.lower_is_better
    assert {w.name: w.higher_is_better for w in _wan_workloads.WORKLOADS.values()} == {
        "digits": True, "fashion": True, "charlm": False}
    assert {w.name: w.higher_is_better for w in _zoo_workloads.WORKLOADS.values()} == {
        "digits": True, "fashion": True, "charlm": False}
