"""Site-local datasets: packed Arrow IPC shards + a manifest, memory-mapped readers, a
deterministic global order with exact resume, and a byte-budgeted cache in front of S3.

    hfleet data pack rows.npz data/site-a --site hospital
    ds = hybridfleet.data.open_dataset("data/site-a")          # or s3://bucket/site-a
    loader = hybridfleet.data.Loader(ds, batch_size=32, seed=0, rank=r, world=w)

Framework wrappers (map-style and iterable datasets) live in `hybridfleet.data.torch`
and `hybridfleet.data.paddle`; importing this package imports neither framework.
"""

from hybridfleet.data.cache import SiteCache
from hybridfleet.data.dataset import PackedDataset, open_dataset
from hybridfleet.data.loader import Loader
from hybridfleet.data.manifest import DatasetManifest, read_manifest
from hybridfleet.data.order import GlobalOrder
from hybridfleet.data.pack import pack

__all__ = ["DatasetManifest", "GlobalOrder", "Loader", "PackedDataset", "SiteCache", "open_dataset", "pack",
           "read_manifest"]
