"""Where hybridfleet keeps state that is not a run's: the project's own ``.hfleet/`` folder.

The registry's default database and the site-data cache live in the project, next to
``runs/``, never in the user's home: two clones on one machine never share a registry by
accident, and ``make clean`` removes them. The project is ``$HFLEET_PROJECT_DIR`` if set, else
the nearest folder from the working directory upward that holds ``.hfleet/``, ``.git`` or
``pyproject.toml``, else the working directory itself.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ENV = "HFLEET_PROJECT_DIR"
STATE_DIR = ".hfleet"
_MARKERS = (STATE_DIR, ".git", "pyproject.toml")


def project_dir(start: str | os.PathLike[str] | None = None) -> Path:
    """The project folder (see the module docstring)."""
    if os.environ.get(PROJECT_ENV):
        return Path(os.environ[PROJECT_ENV]).expanduser().resolve()
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if any((folder / marker).exists() for marker in _MARKERS):
            return folder
    return here


def state_dir(start: str | os.PathLike[str] | None = None) -> Path:
    """``<project>/.hfleet``: the registry's default database, the site-data cache."""
    return project_dir(start) / STATE_DIR
