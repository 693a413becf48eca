"""Pack the two charlm sites (and both together, for the alone-on-all run) into the datasets the jobs train from.

    python examples/charlm/pack_sites.py                         # writes examples/charlm/data/{site-a,site-b,all}
    python examples/charlm/pack_sites.py --out DIR --max-bytes 200000   # a small slice (tests)

Each site's text goes through `hfleet data pack` (an .npz of non-overlapping uint8
windows of ``--window`` bytes in, Arrow IPC shards + manifest out), as a site would
pack its own data. The held-out test packages are not packed: every worker reads them
from the interpreter's standard library (see charlm_data.py).
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from charlm_data import WINDOW, split_rows

HERE = Path(__file__).resolve().parent
SITES = {"site-a": "hospital", "site-b": "cloud", "all": "all"}

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", type=Path, default=HERE / "data", help="folder that receives site-a, site-b and all")
parser.add_argument("--max-bytes", type=int, default=None, help="pack only the first N bytes of each site's text")
parser.add_argument("--window", type=int, default=WINDOW, help="bytes per row: the longest context + 1")
args = parser.parse_args()

for folder, site in SITES.items():
    rows = split_rows(f"charlm:{folder}", args.max_bytes, args.window)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{folder}.npz"
        np.savez(src, window=rows)
        subprocess.run([sys.executable, "-m", "hybridfleet.cli.app", "data", "pack", str(src),
                        str(args.out / folder), "--site", site, "--overwrite"], check=True)
