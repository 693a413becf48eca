"""Pack the two digits sites into the datasets the shipped jobs train from, and save their shared test set.

    python examples/digits/pack_sites.py            # writes examples/digits/data/site-{a,b} and data/test.npz

Each site's rows go through `hfleet data pack` (an .npz of 8x8 uint8 images and
labels in, Arrow IPC shards + manifest out), as a site would pack its own data.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from digits_data import TEST_DATA, split_rows, test_rows

HERE = Path(__file__).resolve().parent
SITES = {"site-a": ("digits:site-a", "hospital"), "site-b": ("digits:site-b", "cloud")}


def as_uint8(x):
    return np.rint(x * 16).astype(np.uint8).reshape(-1, 8, 8)


for folder, (split, site) in SITES.items():
    x, y = split_rows(split)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{folder}.npz"
        np.savez(src, pixels=as_uint8(x), label=y)
        subprocess.run([sys.executable, "-m", "hybridfleet.cli.app", "data", "pack", str(src),
                        str(HERE / "data" / folder), "--site", site, "--overwrite"], check=True)
x_test, y_test = test_rows()  # the shared test set is no site's data: every worker reads the same file
np.savez_compressed(TEST_DATA, pixels=as_uint8(x_test), label=y_test)
