"""Headless Chromium for the report and UI tests: Debian's `chromium` driven by Playwright.

Installed by `.ci/install-chromium.sh` (called from `.ci/run`); Playwright cannot
download browsers here, so it runs /usr/bin/chromium. The tests skip with the install
hint only where the binary or the package is truly absent.
"""

from __future__ import annotations

import io
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
from tests.needs import missing

INSTALL_HINT = "Chromium is not installed: run .ci/install-chromium.sh (apt-get install chromium)"


@contextmanager
def chromium_page():
    binary = shutil.which("chromium")
    if binary is None:
        missing(INSTALL_HINT)
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            yield page
        finally:
            browser.close()


def pixel_stddev(png: bytes) -> float:
    """Standard deviation of the grey levels of a PNG: near 0 for a blank image."""
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


SCREENSHOTS_ENV = "HFLEET_UI_SCREENSHOTS"


def save_screenshot(page, name: str) -> bytes:
    """A full-page screenshot of ``page`` kept as a CI artifact: ``$HFLEET_UI_SCREENSHOTS/NAME.png``
    (default tests/artifacts/ui/, ignored by git); returns the PNG."""
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or Path(__file__).resolve().parent / "artifacts" / "ui")
    folder.mkdir(parents=True, exist_ok=True)
    png = page.screenshot(full_page=True)
    (folder / f"{name}.png").write_bytes(png)
    return png
