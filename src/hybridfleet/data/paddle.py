"""PaddlePaddle datasets over a packed dataset: ``import hybridfleet.data.paddle as hfd``.

The same three pieces as `hybridfleet.data.torch`, on ``paddle.io``: `MapDataset` with
`OrderSampler` (for ``paddle.io.DataLoader(ds, batch_sampler=BatchSampler(sampler=...))``)
and `BatchIterable` (whole batches gathered in the loader's workers).
"""

from __future__ import annotations

from paddle.io import Dataset, IterableDataset, Sampler, get_worker_info

from hybridfleet.data._frontends import OrderSamplerBase, iter_batches, row_arrays
from hybridfleet.data.dataset import PackedDataset
from hybridfleet.data.order import GlobalOrder


class MapDataset(Dataset):
    """Row ``i`` as a dict of numpy arrays (numeric columns; paddle's collate makes tensors)."""

    def __init__(self, dataset: PackedDataset):
        super().__init__()
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return row_arrays(self.dataset, i)


class OrderSampler(OrderSamplerBase, Sampler):
    """The rank's rows of the global order from its current position (see `GlobalOrder`)."""


class BatchIterable(IterableDataset):
    """The rank's batches for the current epoch as numpy arrays, gathered in the loader's workers."""

    def __init__(self, dataset: PackedDataset, order: GlobalOrder, batch_size: int):
        super().__init__()
        self.dataset, self.order, self.batch_size = dataset, order, batch_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        yield from iter_batches(self.dataset, self.order, self.batch_size, worker, workers)
