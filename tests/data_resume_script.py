"""Read a packed dataset in the global order, checkpointing the loader position every step.

    python tests/data_resume_script.py DATASET CKPT_DIR --rank R --world W --steps N [--pause-after K]

Resumes from the newest checkpoint in CKPT_DIR (state ``sampler``: the loader's
position; ``rows``: the sample ids read so far). With --pause-after K it prints
``SAVED K`` after step K and waits to be killed.
"""

import argparse
import json
import sys
import time

import numpy as np

from hybridfleet.ckpt import load_checkpoint, save_checkpoint
from hybridfleet.data import Loader, open_dataset
from hybridfleet.errors import CheckpointError

parser = argparse.ArgumentParser()
parser.add_argument("dataset")
parser.add_argument("ckpt")
parser.add_argument("--rank", type=int, default=0)
parser.add_argument("--world", type=int, default=1)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch", type=int, default=7)
parser.add_argument("--pause-after", type=int, default=None)
args = parser.parse_args()

loader = Loader(open_dataset(args.dataset), args.batch, seed=3, rank=args.rank, world=args.world)
rows: list[int] = []
start = 0
try:
    info = load_checkpoint(args.ckpt)
    loader.load_state_dict(info.state["sampler"])
    rows, start = info.state["rows"], info.step
except CheckpointError:
    pass
batches = iter(loader)
for step in range(start + 1, args.steps + 1):
    batch = next(batches)
    assert np.array_equal(batch["id"], batch["_row"])  # the id column is the row number
    rows += batch["id"].tolist()
    save_checkpoint(args.ckpt, step, tensors={"seen": np.array([len(rows)])},
                    state={"sampler": loader.state_dict(), "rows": rows})
    if args.pause_after == step:
        print(f"SAVED {step}", flush=True)
        time.sleep(600)
print(json.dumps(rows))
sys.stdout.flush()
