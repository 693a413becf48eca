"""How a shard combines the updates of one synchronous round: one plug-in kind, one conformance suite.

A rule collects each contributor's update with its weight (the number of workers it
stands for, e.g. a site leader's ``contributors``) and, when the round closes, returns
the update the optimizer applies. `MeanRound` is the plain weighted mean; the robust
rules (`hybridfleet.ps.aggregate.robust`) implement the same interface.
"""

from __future__ import annotations

from hybridfleet.ps.aggregate.base import RoundAggregator
from hybridfleet.ps.aggregate.mean import MeanRound
from hybridfleet.ps.aggregate.robust import MedianRound, NormClipRound, TrimmedMeanRound

RULES = ("mean", "median", "trimmed_mean", "norm_clip")


def make_round(spec) -> RoundAggregator:
    """A fresh round for the job's ``ps.aggregate`` settings (an `AggregateSpec`)."""
    if spec.rule == "median":
        return MedianRound()
    if spec.rule == "trimmed_mean":
        return TrimmedMeanRound(spec.trim_fraction)
    if spec.rule == "norm_clip":
        return NormClipRound(spec.clip_norm)
    return MeanRound()


__all__ = ["RULES", "MeanRound", "MedianRound", "NormClipRound", "RoundAggregator", "TrimmedMeanRound", "make_round"]
