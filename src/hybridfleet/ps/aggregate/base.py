"""The interface every aggregation rule implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class RoundAggregator(ABC):
    """The updates of one round, by contributor, until the round closes.

    ``add`` is called once per contributor and may keep the arrays it is given (they are
    fresh decodes owned by the round); ``result`` is called once, when the round closes.
    """

    def __init__(self) -> None:
        self.contributors: set[str] = set()
        self.weight = 0

    def add(self, contributor: str, update: dict[str, np.ndarray], weight: int = 1) -> None:
        """Take ``contributor``'s update, standing for ``weight`` workers (>= 1)."""
        if contributor in self.contributors:
            raise ValueError(f"{contributor} already contributed to this round")
        self._add(update, max(1, weight))
        self.contributors.add(contributor)
        self.weight += max(1, weight)

    @abstractmethod
    def _add(self, update: dict[str, np.ndarray], weight: int) -> None:
        """Fold one update in."""

    @abstractmethod
    def result(self) -> dict[str, np.ndarray]:
        """The round's combined update, per key."""
