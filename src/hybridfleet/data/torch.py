"""PyTorch datasets over a packed dataset: ``import hybridfleet.data.torch as hfd``.

- `MapDataset` + `OrderSampler`: for ``torch.utils.data.DataLoader(ds, sampler=...)``; the
  order comes from the sampler, so it is the same for any ``num_workers``.
- `BatchIterable`: whole batches gathered in the worker (``DataLoader(it, batch_size=None)``);
  the loader reads its workers in turn, so the sequence does not depend on ``num_workers``.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from hybridfleet.data._frontends import OrderSamplerBase, iter_batches, row_arrays
from hybridfleet.data.dataset import PackedDataset
from hybridfleet.data.order import GlobalOrder


def _tensors(batch: dict) -> dict:
    return {k: torch.from_numpy(v) if hasattr(v, "dtype") and v.dtype.kind in "biuf" else v for k, v in batch.items()}


class MapDataset(Dataset):
    """Row ``i`` as a dict of tensors (numeric columns) and Python values (the others)."""

    def __init__(self, dataset: PackedDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return _tensors(row_arrays(self.dataset, i))


class OrderSampler(OrderSamplerBase, Sampler):
    """The rank's rows of the global order from its current position (see `GlobalOrder`)."""


class BatchIterable(IterableDataset):
    """The rank's batches for the current epoch, gathered in the loader's workers."""

    def __init__(self, dataset: PackedDataset, order: GlobalOrder, batch_size: int):
        self.dataset, self.order, self.batch_size = dataset, order, batch_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for batch in iter_batches(self.dataset, self.order, self.batch_size, worker, workers):
            yield _tensors(batch)
