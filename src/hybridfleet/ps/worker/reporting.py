"""Reporting for a worker session: byte counters, the egress scan, the parameters' digest and
metrics records (collected into the run's metrics.jsonl by `hfleet run`).

`SessionReporting` is one part of `hybridfleet.ps.worker.session.PSSession`.
"""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.obs.scalars import record_report

log = get_logger("ps.worker")


class SessionReporting:
    """What a session has sent and received, and its metrics records."""

    def bytes_moved(self) -> dict[str, int]:
        """Bytes this worker's client sent and received, in total and by kind of message."""
        lan = {"site_lan_bytes": (self.hub or self.link).lan_bytes} if (self.hub or self.link) else {}
        if self.client is None:
            return {"sent": 0, "received": 0, **lan}
        sent, received = dict(self.client.bytes.sent), dict(self.client.bytes.received)
        return {"sent": sum(sent.values()), "received": sum(received.values()),
                **{f"sent_{k}": v for k, v in sent.items()},
                **{f"received_{k}": v for k, v in received.items()}, **lan}

    def scan_egress(self, rows) -> dict | None:
        """In the egress test mode, search everything this worker sent so far for each of ``rows``
        (its training data, one row per first-axis entry); the result also goes into the final
        metrics record. None when the mode is off (or this worker sent nothing to the shards)."""
        if self.client is None:
            return None
        capture, counted = self.client.bytes.stop_capture()
        if capture is None:
            return None
        from hybridfleet.ps.worker.egress import scan_rows

        self._egress = {**scan_rows(capture.path.read_bytes(), np.asarray(rows)), "bytes_counted": counted}
        return self._egress

    def params_digest(self) -> str:
        """sha256 over the parameters (sorted by name): equal digests mean bit-identical models."""
        h = hashlib.sha256()
        for k in sorted(self._flat):
            h.update(k.encode())
            h.update(self._flat[k].tobytes())
        return h.hexdigest()

    def report(self, step: int | None = None, **metrics) -> None:
        """Log a metrics record (collected into the run's metrics.jsonl by `hfleet run`); a final
        record (``final=True``) also carries the parameters' digest. ``step`` defaults to the pushes made."""
        step = self.step_count if step is None else step
        if self.dp is not None:
            from hybridfleet.privacy import epsilon_spent

            p = self.ps.privacy
            metrics.setdefault("dp_epsilon", round(epsilon_spent(p.noise_multiplier, self.step_count, p.delta), 6))
            metrics.setdefault("dp_delta", p.delta)
        if self.skipped_nonfinite:
            metrics.setdefault("rounds_skipped_nonfinite", self.skipped_nonfinite)
        if metrics.get("final"):
            metrics.setdefault("params_sha256", self.params_digest())
            data = sys.modules.get("hybridfleet.data.dataset")  # only when the script read a packed dataset
            if data is not None and data.opened_digests():
                metrics.setdefault("datasets", data.opened_digests())
                if data.cache_stats():
                    metrics.setdefault("data_cache", data.cache_stats())
            if self._egress is not None:
                metrics.setdefault("egress", self._egress)
        c = self.config
        record_report(step, metrics, self.framework)
        log.info("metrics", worker=c.worker_id, site=c.site, rank=c.rank, step=step,
                 elapsed_s=round(time.monotonic() - self._started, 3), **metrics, **self.bytes_moved(),
                 phase_s=self.timer.phase_totals())
