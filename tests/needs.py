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


def skip_outside_ci(reason: str | None):
    """A mark: skip with ``reason`` (what is missing and how to install it) when it is set, except under CI,
    where the test runs and fails loudly."""
    return pytest.mark.skipif(reason is not None and not os.environ.get("CI"), reason=reason or "")
