"""Progress display while the supervisor waits for a job.

The caller supplies a function returning ``(completed, total, description)``;
`ProgressReporter` shows it on stderr. On a terminal that is a rich progress
bar redrawn on every `refresh` (the supervisor calls it about twice a second);
anywhere else (a log file, CI) it is one plain line every ``plain_interval_s``
so that logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Callable

from hybridfleet.obs.log import get_logger

ProgressFn = Callable[[], "tuple[float, float, str]"]

_log = get_logger("supervisor")


def format_progress_line(completed: float, total: float, description: str) -> str:
    """One plain progress line: ``progress: 40/100 (40%) epoch 2`` (no percentage when total <= 0)."""
    text = f"progress: {completed:g}/{total:g} ({100.0 * completed / total:.0f}%)" if total > 0 else f"progress: {completed:g}"
    return f"{text} {description}".rstrip()


class ProgressReporter:
    """Shows ``read_progress()`` on ``stream`` (default: stderr at the time of writing).

    Use as a context manager and call `refresh` periodically. A failing
    ``read_progress`` never interrupts the caller: the failure is logged once
    and the display keeps its last state.
    """

    def __init__(
        self,
        read_progress: ProgressFn,
        stream: IO[str] | None = None,
        plain_interval_s: float = 10.0,
        terminal: bool | None = None,
    ):
        if plain_interval_s <= 0:
            raise ValueError(f"plain_interval_s: must be > 0 (got {plain_interval_s})")
        self._read_progress = read_progress
        self._stream = stream
        self._plain_interval_s = plain_interval_s
        self._terminal = terminal
        self._bar = None
        self._task_id = None
        self._last_plain_s: float | None = None
        self._last_line: str | None = None
        self._failure_logged = False

    def _out(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def __enter__(self) -> "ProgressReporter":
        terminal = self._terminal
        if terminal is None:
            isatty = getattr(self._out(), "isatty", None)
            terminal = bool(isatty and isatty())
        if terminal:
            self._start_bar()
        self.refresh()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._bar is not None:
            self.refresh()
            self._bar.stop()
            self._bar = None
        else:
            self._write_plain(force=True)

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        console = Console(file=self._stream, stderr=self._stream is None, force_terminal=True)
        # Redraws happen only in refresh(): no extra thread competes with log echo.
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,
        )
        self._bar.start()
        self._task_id = self._bar.add_task("", total=None)

    def _read(self) -> tuple[float, float, str] | None:
        try:
            completed, total, description = self._read_progress()
            return float(completed), float(total), str(description)
        except Exception as err:  # the caller's parser must not break the wait loop
            if not self._failure_logged:
                _log.warning("progress_failed", error=repr(err))
                self._failure_logged = True
            return None

    def refresh(self) -> None:
        """Read the progress now and redraw the bar (terminal) or, when due, write a plain line."""
        if self._bar is not None:
            state = self._read()
            if state is not None:
                completed, total, description = state
                self._bar.update(self._task_id, completed=completed, total=total if total > 0 else None, description=description)
            self._bar.refresh()
        else:
            self._write_plain(force=False)

    def _write_plain(self, force: bool) -> None:
        now_s = time.monotonic()
        due = self._last_plain_s is None or now_s - self._last_plain_s >= self._plain_interval_s
        if not (due or force):
            return
        state = self._read()
        if state is None:
            return
        line = format_progress_line(*state)
        if force and line == self._last_line:
            return
        self._last_plain_s = now_s
        self._last_line = line
        out = self._out()
        out.write(line + "\n")
        out.flush()
