"""`hfleet registry promote --evaluate SCRIPT`: measure a version on its stored weights in a subprocess.

The contract of an evaluation script:

- it runs as ``python SCRIPT WEIGHTS`` where ``WEIGHTS`` is the version's verified weights,
  pulled from the registry's store as ``model.safetensors`` laid out for the version's
  framework (also in ``$HFLEET_EVAL_WEIGHTS``; ``$HFLEET_EVAL_FRAMEWORK`` names the
  framework, ``$HFLEET_EVAL_MODEL`` the version as ``NAMESPACE/NAME@N``);
- it prints exactly one JSON object of finite numbers on stdout
  (``{"test_accuracy": 0.97}``) and exits 0; anything else it has to say goes to stderr.

The bytes that run are a copy of the script taken when it was hashed, so the recorded
sha256 is the sha256 of what measured the figure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridfleet.errors import RegistryError
from hybridfleet.registry.evidence import Measurement, finite_metrics

DEFAULT_TIMEOUT_S = 600.0
_TAIL_CHARS = 400


def _tail(text: str) -> str:
    text = (text or "").strip()
    return text[-_TAIL_CHARS:].replace("\n", " | ") if text else "(nothing)"


def measure(reg: Any, ref: str, script: str | os.PathLike[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> Measurement:
    """Pull ``ref`` (verified), run ``script`` on it and return what it measured.

    RegistryError (nothing recorded anywhere) when the script is missing, fails, times
    out, or prints anything but one JSON object of finite numbers.
    """
    path = Path(script)
    if not path.is_file():
        raise RegistryError(f"--evaluate {script}: no such script")
    if not timeout_s > 0:
        raise RegistryError(f"--evaluate-timeout must be > 0 seconds (got {timeout_s})")
    code = path.read_bytes()
    digest = hashlib.sha256(code).hexdigest()
    info = reg.get_version(ref)
    framework = info.framework or "torch"
    work = Path(tempfile.mkdtemp(prefix="hfleet-eval-"))
    try:
        pulled = reg.pull(f"{info.name}@{info.version}", framework, "safetensors", str(work / "weights"))
        runnable = work / path.name
        runnable.write_bytes(code)
        env = {**os.environ, "HFLEET_EVAL_WEIGHTS": pulled["path"], "HFLEET_EVAL_FRAMEWORK": framework,
               "HFLEET_EVAL_MODEL": f"{info.name}@{info.version}",
               "PYTHONPATH": os.pathsep.join(p for p in (str(path.resolve().parent), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, str(runnable), pulled["path"]], capture_output=True, text=True,
                                  env=env, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RegistryError(f"--evaluate {path.name}: no result within {timeout_s:g} s; nothing recorded") from None
        wall_s = time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0:
        raise RegistryError(f"--evaluate {path.name} exited {done.returncode}; nothing recorded; its stderr: "
                            f"{_tail(done.stderr)}")
    try:
        metrics = json.loads(done.stdout)
    except json.JSONDecodeError:
        metrics = None
    if not isinstance(metrics, dict) or not metrics:
        raise RegistryError(f"--evaluate {path.name} must print one JSON object of metrics on stdout "
                            f"(e.g. {{\"test_accuracy\": 0.97}}); it printed: {_tail(done.stdout)}; nothing recorded")
    return Measurement(metrics=finite_metrics(metrics, f"--evaluate {path.name}", "nothing recorded"), script=path.name,
                       script_sha256=digest, manifest_sha256=info.manifest_sha256, at_s=time.time(), wall_s=wall_s)  # fmt: skip
