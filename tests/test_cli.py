"""The `hfleet` command as a user meets it: help, import hygiene, the exit-code table."""

from __future__ import annotations

import subprocess
import sys

import hybridfleet.errors as errors


def test_help_lists_every_command_group():
    out = subprocess.run([sys.executable, "-m", "hybridfleet", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for group in ("spec", "env", "image", "certs", "run", "ps", "worker", "launch", "k8s", "ckpt"):
        assert f" {group} " in out, group


def test_importing_hybridfleet_and_its_cli_imports_neither_framework():
    code = ("import sys, hybridfleet, hybridfleet.cli.app, hybridfleet.ps.worker, hybridfleet.ps.server, "
            "hybridfleet.launch.psjob, hybridfleet.codec, hybridfleet.ckpt, hybridfleet.env.check; "
            "bad = [m for m in ('torch', 'paddle') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_error_kind_has_an_exit_code_and_hint():
    kinds = {cls.kind for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.HfleetError)}
    assert kinds <= set(errors.EXIT_CODES)
    codes = [c.code for c in errors.EXIT_CODES.values()]
    assert len(codes) == len(set(codes))
    assert all(c.hint for k, c in errors.EXIT_CODES.items() if k != "ok")


def test_unknown_command_is_a_usage_error_not_a_traceback():
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "frobnicate"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
