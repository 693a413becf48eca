"""How a shard combines the updates of one synchronous round: one plug-in kind, one conformance suite.

A rule collects each contributor's update with its weight (the number of workers it
stands for, e.g. a site leader's ``contributors``) and, when the round closes, returns
the update the optimizer applies. `MeanRound` is the plain weighted mean; robust rules
and secure aggregation implement the same interface.
"""

from hybridfleet.ps.aggregate.base import RoundAggregator
from hybridfleet.ps.aggregate.mean import MeanRound

__all__ = ["RoundAggregator", "MeanRound"]
