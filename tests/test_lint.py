"""The code lints clean for the lowest supported Python (3.10), and the lint really catches 3.11+ code."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

NEWER_THAN_310 = {
    "import tomllib\n": "`tomllib` is banned",
    "import datetime\nNOW = datetime.datetime.now(datetime.UTC)\n": "`datetime.UTC` is banned",
    "from enum import StrEnum\n": "`enum.StrEnum` is banned",
    "from typing import Self\n": "`typing.Self` is banned",
    "try:\n    pass\nexcept* ValueError:\n    pass\n": "Cannot use `except*` on Python 3.10",
    "E = ExceptionGroup('x', [ValueError()])\n": "Undefined name `ExceptionGroup`",
    "import hashlib\nD = hashlib.file_digest\n": "`hashlib.file_digest` is banned",
}


def _ruff(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(REPO / "pyproject.toml"),
                           "--output-format", "concise", "--no-cache", *paths],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_sources_tests_and_benches_lint_clean_for_python_310():
    result = _ruff("src", "tests", "bench", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_lint_refuses_each_python_311_feature(tmp_path):
    for index, (code, message) in enumerate(NEWER_THAN_310.items()):
        path = tmp_path / f"newer_{index}.py"
        path.write_text(code)
        result = _ruff(str(path))
        assert result.returncode == 1 and message in result.stdout, (code, result.stdout)
