"""The weighted mean: what plain data-parallel SGD computes."""

from __future__ import annotations

import numpy as np

from hybridfleet.ps.aggregate.base import RoundAggregator


class MeanRound(RoundAggregator):
    """Running per-key sums, divided by the total weight when the round closes.

    A contributor's update already sums ``weight`` workers' gradients (a site leader
    pushes its site's sum), so sums are added as they come and divided once."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, np.ndarray] = {}

    def _add(self, update: dict[str, np.ndarray], weight: int) -> None:
        for key, value in update.items():
            if key in self.sums:
                self.sums[key] += value
            else:
                self.sums[key] = value if value.flags.writeable else value.copy()

    def result(self) -> dict[str, np.ndarray]:
        if self.weight > 1:
            for s in self.sums.values():  # the round owns its sums: average in place
                np.divide(s, self.weight, out=s)
        return self.sums
