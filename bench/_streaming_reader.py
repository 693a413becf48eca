"""MosaicML Streaming's side of bench/data.py, run by an interpreter that has `mosaicml-streaming`.

    /opt/mds-venv/bin/python bench/_streaming_reader.py --rows X.npy --labels Y.npy --work DIR

Streaming pins numpy<2.2, torchvision and transformers, which conflict with this project's
pins, so it lives in its own virtual environment (`.ci`-free; see bench/data.py's
``--streaming-python``). The rows bench/data.py wrote are converted to MDS shards
(``MDSWriter``, no compression), then read once by a `StreamingDataset` (local, shuffled)
through a torch DataLoader with the bench's batch size and worker count. Prints one JSON
line: {"samples_per_s": ..., "rows": ..., "version": ...}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", required=True, help=".npy of uint8 rows (n, row_bytes)")
    parser.add_argument("--labels", required=True, help=".npy of int64 labels (n,)")
    parser.add_argument("--work", required=True, help="folder for the MDS shards")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-mb", type=float, default=64.0)
    args = parser.parse_args()

    import streaming
    from streaming import MDSWriter, StreamingDataset
    from torch.utils.data import DataLoader

    x = np.load(args.rows, mmap_mode="r")
    y = np.load(args.labels)
    out = Path(args.work) / "mds"
    columns = {"x": f"ndarray:uint8:{x.shape[1]}", "label": "int64"}
    with MDSWriter(out=str(out), columns=columns, compression=None, size_limit=int(args.shard_mb * (1 << 20))) as writer:
        for i in range(len(x)):
            writer.write({"x": np.asarray(x[i]), "label": int(y[i])})
    dataset = StreamingDataset(local=str(out), shuffle=True, shuffle_seed=0, batch_size=args.batch)
    loader = DataLoader(dataset, batch_size=args.batch, num_workers=args.workers)
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch["label"])
    seconds = time.perf_counter() - start
    print(json.dumps({"samples_per_s": count / seconds, "rows": count, "version": streaming.__version__}))


if __name__ == "__main__":
    main()
