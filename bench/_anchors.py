"""What each benchmark needs beside hybridfleet (the tools it compares against), checked before it starts.

Every anchor comes from one extra, so a fresh clone runs every benchmark after

    pip install -e '.[bench]'

except MosaicML Streaming (bench/data.py), which pins packages against this project's and
lives in its own virtual environment: `make bench-streaming-venv` creates it.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

INSTALL = "pip install -e '.[bench]'"


def require(bench: str, anchors: dict[str, str], programs: dict[str, str] | None = None) -> None:
    """Exit with status 2 and one line naming what is missing and the command that installs it,
    unless every module of ``anchors`` (module name -> what it is) imports and every program of
    ``programs`` is installed next to this interpreter or on PATH."""
    missing = []
    for module, what in anchors.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{what} (`{module}`)")
    for program, what in (programs or {}).items():
        if not Path(sys.executable).with_name(program).exists() and shutil.which(program) is None:
            missing.append(f"{what} (`{program}`)")
    if missing:
        print(f"{bench}: missing {', '.join(missing)}; install every benchmark's anchors with: {INSTALL}", file=sys.stderr)
        sys.exit(2)
