"""The global sample order: a function of (seed, epoch) alone, split across ranks.

Epoch ``e`` visits every row once in the order ``permutation(seed, e)``. A global
position ``p`` counts rows consumed by all ranks together; from ``p`` on, rank ``r`` of
``w`` reads ``order[p:][r::w]``. So the rows consumed by the job at each global step are
the same whatever the number of ranks, ranks never overlap, and a resumed run that
starts at the saved position reads exactly what the uninterrupted run would have read.
The epoch's tail that does not divide evenly among ranks is dropped, so every rank takes
the same number of steps (the next epoch reshuffles and covers those rows again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridfleet.errors import DataError


def permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch ``epoch``: depends only on (num_rows, seed, epoch)."""
    return np.random.Generator(np.random.PCG64([int(seed), int(epoch)])).permutation(num_rows)


@dataclass
class GlobalOrder:
    """Rank ``rank`` of ``world``'s share of the global order, with a resumable position."""

    num_rows: int
    seed: int = 0
    rank: int = 0
    world: int = 1
    shuffle: bool = True
    epoch: int = 0
    position: int = 0  # rows consumed by all ranks together in this epoch

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise DataError(f"rank must be in [0, world) (got rank {self.rank}, world {self.world})")
        if self.num_rows < self.world:
            raise DataError(f"{self.num_rows} rows cannot be split across {self.world} ranks")

    def epoch_order(self, epoch: int) -> np.ndarray:
        return permutation(self.num_rows, self.seed, epoch) if self.shuffle else np.arange(self.num_rows)

    @property
    def rows_per_epoch(self) -> int:
        """Rows the job consumes per epoch (a multiple of ``world``)."""
        return self.num_rows - self.num_rows % self.world

    def remaining(self) -> np.ndarray:
        """This rank's rows from the current position to the end of the epoch."""
        order = self.epoch_order(self.epoch)[self.position:self.rows_per_epoch]
        return order[self.rank::self.world]

    def advance(self, rows_this_rank: int) -> None:
        """Record that each rank consumed ``rows_this_rank`` more rows; rolls over to the next epoch."""
        self.position += rows_this_rank * self.world
        if self.position >= self.rows_per_epoch:
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict:
        """What a checkpoint stores to resume exactly (``hybridfleet.ckpt`` state ``sampler``)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "num_rows": self.num_rows,
                "world": self.world, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict`; the dataset and seed must be the same ones."""
        if state.get("num_rows") != self.num_rows or state.get("seed") != self.seed:
            raise DataError(f"sampler state is for {state.get('num_rows')} rows with seed {state.get('seed')}, "
                            f"this order has {self.num_rows} rows with seed {self.seed}")
        if state["position"] % self.world:
            raise DataError(f"saved position {state['position']} does not divide among {self.world} ranks")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
