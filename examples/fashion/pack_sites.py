"""Pack the two Fashion-MNIST sites (and both together) into the datasets the shipped jobs train from.

    python examples/fashion/pack_sites.py                  # writes examples/fashion/data/site-{a,b,all}
    python examples/fashion/pack_sites.py --rows 2000 --out /tmp/fashion   # the first 2000 rows of each site

Each site's rows go through `hfleet data pack` (an .npz of 28x28 uint8 images, already
through the site's scanner, and labels in; Arrow IPC shards + manifest out), as a site
would pack its own data. ``site-all`` holds both sites' rows, for training the same
script alone on all the data (examples/fashion-alone.yaml).
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from fashion_data import split_rows

HERE = Path(__file__).resolve().parent
SITES = {"site-a": ("fashion:site-a", "hospital"), "site-b": ("fashion:site-b", "cloud"),
         "site-all": ("fashion:all", "all")}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rows", type=int, default=None, help="pack only the first N rows of each site")
parser.add_argument("--out", type=Path, default=HERE / "data", help="folder of the packed datasets")
args = parser.parse_args()
if args.rows is not None and args.rows < 1:
    parser.error(f"--rows: must be >= 1 (got {args.rows})")

for folder, (split, site) in SITES.items():
    pixels, labels = split_rows(split, args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{folder}.npz"
        np.savez(src, pixels=pixels, label=labels)
        subprocess.run([sys.executable, "-m", "hybridfleet.cli.app", "data", "pack", str(src),
                        str(args.out / folder), "--site", site, "--overwrite"], check=True)
