"""`Loader`: batches of a `PackedDataset` in the global order, with an exact-resume state.

The fast path for both frameworks: each batch is one gather per column (numpy views of
the memory map in, one contiguous array out), handed to ``collate`` (e.g.
``torch.from_numpy``). Its ``state_dict`` is the position after the last batch it
*delivered*, so a checkpoint taken between steps resumes on the next unread row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from hybridfleet.data.dataset import PackedDataset
from hybridfleet.data.order import GlobalOrder


class Loader:
    """Iterate batches of ``batch_size`` rows for rank ``rank`` of ``world``, epoch after epoch."""

    def __init__(self, dataset: PackedDataset, batch_size: int, *, seed: int = 0, rank: int = 0, world: int = 1,
                 shuffle: bool = True, collate: Callable[[dict], object] | None = None):
        from hybridfleet.errors import DataError

        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1 (got {batch_size})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.order = GlobalOrder(len(dataset), seed=seed, rank=rank, world=world, shuffle=shuffle)
        self.collate = collate or (lambda batch: batch)

    def epoch_batches(self) -> Iterator[object]:
        """The rest of the current epoch, batch by batch (the last one may be shorter)."""
        epoch = self.order.epoch
        rows = self.order.remaining()
        for start in range(0, len(rows), self.batch_size):
            idx = rows[start:start + self.batch_size]
            batch = self.dataset.take(idx)
            batch["_row"] = idx
            self.order.advance(len(idx))
            yield self.collate(batch)
            if self.order.epoch != epoch:
                return

    def __iter__(self) -> Iterator[object]:
        """Batches forever, epoch after epoch (stop by step count, as training loops do)."""
        while True:
            yield from self.epoch_batches()

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
