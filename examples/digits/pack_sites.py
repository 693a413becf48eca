"""Pack the two digits sites into the datasets the shipped jobs train from.

    python examples/digits/pack_sites.py            # writes examples/digits/data/split.npz and data/site-{a,b}

Each site's rows go through `hfleet data pack` (an .npz of 8x8 uint8 images and
labels in, Arrow IPC shards + manifest out), as a site would pack its own data.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from digits_data import SPLIT, sklearn_split, split_rows

HERE = Path(__file__).resolve().parent
SITES = {"site-a": ("digits:site-a", "hospital"), "site-b": ("digits:site-b", "cloud")}
np.savez_compressed(SPLIT, **sklearn_split())  # the train/test split the named splits and the test set read


def as_uint8(x):
    return np.rint(x * 16).astype(np.uint8).reshape(-1, 8, 8)


for folder, (split, site) in SITES.items():
    x, y = split_rows(split)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{folder}.npz"
        np.savez(src, pixels=as_uint8(x), label=y)
        subprocess.run([sys.executable, "-m", "hybridfleet.cli.app", "data", "pack", str(src),
                        str(HERE / "data" / folder), "--site", site, "--overwrite"], check=True)

