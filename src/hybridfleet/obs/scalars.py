"""Values a training script reports, sent to Prometheus and to TensorBoard or VisualDL.

`record_report` is what ``ps.report(...)`` and `hybridfleet.launch.helpers.report`
call: every number becomes ``hybridfleet_reported_value{metric=NAME}`` and, when a
scalar writer is chosen, a scalar at that step. One option chooses the writer,
``HFLEET_SCALARS`` (``hfleet run --scalars``):

* ``auto`` (default): TensorBoard event files for torch, VisualDL logs for paddle,
  when that package is installed; nothing otherwise;
* ``tensorboard`` / ``visualdl``: that writer (refused up front when not installed);
* ``off``: none.

Files go to ``HFLEET_SCALARS_DIR`` or ``$HFLEET_RUN_DIR/scalars``, one directory per
process (``HFLEET_PROCESS_NAME``), so ``tensorboard --logdir RUN_DIR/scalars`` or
``visualdl --logdir RUN_DIR/scalars`` shows every worker side by side.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

from hybridfleet.errors import LaunchError
from hybridfleet.obs.log import get_logger
from hybridfleet.obs.metrics import process_metrics

ENV_SCALARS = "HFLEET_SCALARS"
ENV_SCALARS_DIR = "HFLEET_SCALARS_DIR"
CHOICES = ("auto", "tensorboard", "visualdl", "off")
# the package each writer needs, and the pip hint when it is missing
_NEEDS = {"tensorboard": ("tensorboard", "pip install tensorboard"), "visualdl": ("visualdl", "pip install visualdl")}

_log = get_logger("obs.scalars")


def _installed(kind: str) -> bool:
    return importlib.util.find_spec(_NEEDS[kind][0]) is not None


def resolve_writer(choice: str, framework: str | None) -> str | None:
    """The writer ``choice`` means for ``framework``: ``tensorboard``, ``visualdl`` or None.

    Raises `LaunchError` for an unknown choice or an explicit writer whose package is missing.
    """
    choice = (choice or "auto").strip().lower()
    if choice not in CHOICES:
        raise LaunchError(f"{ENV_SCALARS} / --scalars: must be one of {', '.join(CHOICES)} (got {choice!r})")
    if choice == "off":
        return None
    if choice == "auto":
        kind = "visualdl" if framework == "paddle" else "tensorboard"
        return kind if _installed(kind) else None
    if not _installed(choice):
        raise LaunchError(f"--scalars {choice}: the {_NEEDS[choice][0]!r} package is not installed; "
                          f"{_NEEDS[choice][1]}")
    if choice == "tensorboard" and importlib.util.find_spec("torch") is None:
        raise LaunchError("--scalars tensorboard writes through torch.utils.tensorboard, which needs torch; "
                          "use --scalars visualdl for paddle-only environments")
    return choice


class ScalarWriter:
    """A TensorBoard ``SummaryWriter`` or a VisualDL ``LogWriter`` behind one ``add(step, values)``."""

    def __init__(self, kind: str, logdir: Path):
        self.kind = kind
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(logdir))
        elif kind == "visualdl":
            from visualdl import LogWriter

            self._writer = LogWriter(logdir=str(logdir))
        else:
            raise ValueError(f"unknown scalar writer {kind!r}")

    def add(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            if self.kind == "tensorboard":
                self._writer.add_scalar(tag, value, step)
            else:
                self._writer.add_scalar(tag=tag, value=value, step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


_writer: ScalarWriter | None = None
_writer_ready = False
_writer_lock = threading.Lock()


def _process_writer(framework: str | None) -> ScalarWriter | None:
    """This process's writer per ``HFLEET_SCALARS`` (made on the first report; None when off)."""
    global _writer, _writer_ready
    if _writer_ready:
        return _writer
    with _writer_lock:
        if _writer_ready:
            return _writer
        _writer_ready = True
        try:
            kind = resolve_writer(os.environ.get(ENV_SCALARS, "auto"), framework)
        except LaunchError as err:  # a training script keeps training; the choice is checked by `hfleet run`
            _log.warning("scalars_off", error=str(err))
            return None
        base = os.environ.get(ENV_SCALARS_DIR) or (
            str(Path(os.environ["HFLEET_RUN_DIR"]) / "scalars") if os.environ.get("HFLEET_RUN_DIR") else "")
        if kind is None or not base:
            return None
        try:
            _writer = ScalarWriter(kind, Path(base) / os.environ.get("HFLEET_PROCESS_NAME", f"pid-{os.getpid()}"))
        except Exception as err:  # e.g. an unwritable directory: metrics still flow to Prometheus and the logs
            _log.warning("scalars_off", writer=kind, error=repr(err))
            return None
        atexit.register(_writer.close)
        return _writer


def numeric(values: dict[str, Any]) -> dict[str, float]:
    """The finite-number entries of ``values`` (booleans excluded)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
            out[k] = float(v)
    return out


def record_report(step: int, values: dict[str, Any], framework: str | None = None) -> None:
    """Publish a script's report: Prometheus gauges, and TensorBoard / VisualDL scalars when chosen."""
    nums = numeric(values)
    process_metrics().report(step, nums)
    writer = _process_writer(framework)
    if writer is not None and nums:
        try:
            writer.add(step, nums)
        except Exception as err:  # a full disk must not stop training
            _log.warning("scalars_write_failed", error=repr(err))
