"""What the torch and paddle wrappers share: row access and worker splitting, framework-free."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hybridfleet.data.dataset import PackedDataset
from hybridfleet.data.order import GlobalOrder


def row_arrays(dataset: PackedDataset, i: int) -> dict:
    """Row ``i`` with numeric columns as writable numpy arrays (a framework may take them as they are)."""
    row = dataset[i]
    return {k: np.array(v) if isinstance(v, (np.ndarray, np.generic)) else v for k, v in row.items()}


def iter_batches(dataset: PackedDataset, order: GlobalOrder, batch_size: int, worker_id: int = 0,
                 num_workers: int = 1) -> Iterator[dict]:
    """This rank's batches for the current epoch; loader worker ``worker_id`` takes every
    ``num_workers``-th batch, so a loader that reads its workers in turn yields the
    same sequence as one worker."""
    rows = order.remaining()
    for b, start in enumerate(range(0, len(rows), batch_size)):
        if b % num_workers == worker_id:
            idx = rows[start:start + batch_size]
            batch = dataset.take(idx)
            batch["_row"] = idx
            yield batch


class OrderSamplerBase:
    """The rank's rows of the global order from its current position (see `GlobalOrder`);
    mixed into each framework's ``Sampler``."""

    def __init__(self, order: GlobalOrder):
        super().__init__()
        self.order = order

    def __iter__(self):
        return iter(self.order.remaining().tolist())

    def __len__(self) -> int:
        return len(self.order.remaining())
