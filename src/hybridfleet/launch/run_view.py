"""The live view of one `hfleet run`, from its first second to the summary's figures.

Phases, in order: starting shards, workers joining n/N (members the first shard knows),
training (from the first applied round), site baselines (workers done, the single-site
comparison runs still going), saving the model, publishing, writing the report. Rounds come
from the first shard's Status (the last round seen stays shown once the shards stop); the table's
rates are the workers' own steps, and a worker that exited keeps its last figures, marked with its
exit code from the supervisor's events.
"""

from __future__ import annotations

import contextlib
from typing import IO, Callable

from hybridfleet.obs.discovery import Target
from hybridfleet.obs.live import LiveDisplay, Phases, RunView, final_exits, reported_figures
from hybridfleet.spec.models import JobSpec


class RunProgress:
    """The phases of a run and, with ``enabled``, the live view that shows them."""

    def __init__(self, spec: JobSpec, layout, targets: list[Target], read_events: Callable[[], list[dict]],
                 stream: IO[str] | None = None, enabled: bool = True):
        """``read_events``: the supervisor's events so far (restarts and exits are counted from them)."""
        from hybridfleet.spec.rules import ROUND_SYNC_MODES, outer_rounds

        self.spec, self.layout = spec, layout
        self.phases = Phases()
        self.total_rounds = float(outer_rounds(spec.ps, spec.train.steps)
                                  * (1 if spec.ps.sync in ROUND_SYNC_MODES else spec.num_workers))
        self._probe = None
        self._rounds_seen = 0.0
        view = RunView(spec.name, targets, self._rounds,
                       lambda: sum(1 for e in read_events() if e.get("event") == "restart"), self.phases,
                       read_exits=lambda: final_exits(read_events()), read_reported=lambda: _reported(layout.run_dir))
        self._display = LiveDisplay(view, stream=stream, background=True) if enabled else None

    def __enter__(self) -> "RunProgress":
        if self._display is not None:
            self._display.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stopped = exc_type is KeyboardInterrupt or (exc_type is SystemExit and getattr(exc, "code", None) in (130, 143))
        self.phases.finish("stopped" if stopped else "failed" if exc_type is not None else "done")
        if self._display is not None:
            self._display.__exit__(exc_type, exc, tb)
        if self._probe is not None:
            self._probe.close()

    def phase(self, name: str, detail: str = "") -> None:
        """Begin the named phase (the previous one keeps its time); leaving training reads the rounds once more,
        while the shards still answer, so the final line counts them all. A run whose training fell between
        two refreshes is still "workers joining" here: that read also finds its rounds."""
        if self.phases.current in ("workers joining", "training"):
            self._rounds()
        self.phases.start(name, detail)

    def show_final(self, summary: dict) -> None:
        if self._display is not None:
            self._display.show_final(summary)

    def _status(self) -> dict | None:
        if self._probe is None:
            if not self.layout.shard_addresses:
                return None
            from hybridfleet.ps.worker.status import ShardStatusProbe

            self._probe = ShardStatusProbe(self.layout.shard_addresses[0], self.layout.certs_dir,
                                           lambda: self.layout.tokens.get("admin"),
                                           insecure=self.spec.security.tls == "off")
        with contextlib.suppress(Exception):  # a restarting shard answers nothing for a while
            return self._probe.status()
        return None

    def _rounds(self) -> tuple[float, float]:
        status = self._status()
        if status:  # a stopped shard answers nothing: keep the last round seen
            self._rounds_seen = max(self._rounds_seen, float(status.get("version", 0)))
        version = self._rounds_seen
        current = self.phases.current
        if status and current == "workers joining":
            from hybridfleet.launch.psjob import ps_clients

            self.phases.set_detail(f"{len(status.get('members', {}))}/{ps_clients(self.spec)}")
            if version > 0:
                self.phases.start("training")
        return min(version, self.total_rounds), self.total_rounds

    def wait(self, sup, names: list[str]) -> dict[str, int]:
        """Wait for ``names`` to finish for good; the phase says whether workers or only baselines still run."""
        workers = [n for n in names if n.startswith("worker-")]
        while True:
            try:
                return sup.wait(names, timeout_s=1.0)
            except TimeoutError:
                if self.phases.current != "site baselines" and all(sup.returncode(n) is not None for n in workers):
                    self.phase("site baselines")


def _reported(run_dir) -> dict:
    """Worker process -> its last logged figures (the run's metrics.jsonl), for a worker that no longer answers."""
    from hybridfleet.obs.runinfo import load_run

    try:
        return reported_figures(load_run(run_dir).metrics)
    except (OSError, ValueError):  # a file being written or gone: the view keeps what it scraped
        return {}
