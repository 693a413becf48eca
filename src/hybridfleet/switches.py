"""On/off switches read from the environment (``HFLEET_NATIVE_TLS``, ``HFLEET_SEALED_RECORDS``,
``HFLEET_NATIVE_OPTIM``): on unless set to ``0``, ``off``, ``false`` or ``no``."""

from __future__ import annotations

import os

_OFF = ("0", "off", "false", "no")


def switched_on(name: str) -> bool:
    """True unless the environment variable ``name`` says off (case and surrounding spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() not in _OFF
