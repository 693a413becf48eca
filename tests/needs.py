"""Tests that need a program this machine may lack: skip with the install hint on a
developer's machine, fail under CI (``CI`` set), where `.ci/run` installs everything."""

from __future__ import annotations

import os

import pytest


def missing(message: str):
    """Skip (or, under CI, fail) the calling test because ``message`` names what is missing."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI installs it: see .ci/run)")
    pytest.skip(message)


def only_outside_ci(reason: str | None) -> bool:
    """For ``skipif``: skip when ``reason`` is set, except under CI, where the test runs and fails loudly."""
    return reason is not None and not os.environ.get("CI")
