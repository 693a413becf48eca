"""The site path of a worker session: the leader gathers its followers' gradients and
broadcasts what it pulled; a follower sends its gradient to the leader and trains on what
comes back (`hybridfleet.ps.worker.site` holds the LAN link itself).

`SitePath` is one part of `hybridfleet.ps.worker.session.PSSession`.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.worker.site import SiteLink, flatten, open_hub, unflatten
from hybridfleet.ps.worker.site_security import HubSecurity, LinkSecurity

log = get_logger("ps.worker")


class SitePath:
    """Site aggregation for a session: the leader's hub or a follower's link."""

    def _start_hub(self) -> None:
        """The site leader listens for its followers and waits until they joined (or the timeout)."""
        cfg = self.config
        followers = cfg.job.sites[cfg.site].workers - 1
        self.hub = open_hub(cfg.site_hub, followers, self._numel(), HubSecurity.from_env(cfg.job, cfg.site),
                            sizes=self._sizes(), port_file=cfg.site_hub_file)
        joined = self.hub.wait_for_followers()
        log.info("site_leader_ready", site=cfg.site, followers=joined, expected=followers)

    def _start_follower(self) -> dict[str, np.ndarray]:
        cfg = self.config
        self.link = SiteLink(cfg.site_hub, cfg.site_rank, self._numel(), LinkSecurity.from_client(cfg.site, cfg.security),
                             params=len(self._names), port_file=cfg.site_hub_file)
        self._receive_from_leader()
        log.info("worker_started", worker=cfg.worker_id, site=cfg.site, rank=cfg.rank, site_follower=True,
                 resumed_clock=self.step_count)
        return self.parameters()

    def _receive_from_leader(self) -> None:
        self.step_count, vector = self.link.receive()
        self._flat = {k: v.reshape(-1).copy() for k, v in unflatten(vector, self.shapes, self._names).items()}

    def _sizes(self) -> list[int]:
        """Each parameter's element count, in the site frame's (sorted name) order."""
        return [int(np.prod(self.shapes[n])) if self.shapes[n] else 1 for n in self._names]

    def _dense(self, grads: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(every parameter's gradient in frame order, zeros where there is none; one flag per parameter)."""
        present = np.array([n in grads for n in self._names], dtype=np.uint8)
        full = {n: grads[n] if n in grads else np.zeros(self.shapes[n], np.float32) for n in self._names}
        return flatten(full, self._names), present

    def _follower_step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Send this step's gradients (those it has) to the site leader and take the parameters it pulled."""
        self.link.send(*self._dense(grads))
        before = self.step_count
        self._receive_from_leader()
        self.caught_up += max(0, self.step_count - before - 1)  # the leader caught up: so does its site
        self.timer.mark("wait")
        return self.parameters()

    def _leader_gather(self, grads: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """Hand new followers the current parameters, then sum the site's gradients: (sum, contributors).

        The sum holds the parameters some worker of the site had a gradient for; the others are
        left out, so the shards do not step them."""
        self.hub.admit(flatten(self._flat, self._names), self.step_count)
        total, present, contributors = self.hub.gather_present(*self._dense(grads))
        self.timer.mark("wait")
        summed = unflatten(total, self.shapes, self._names)
        return {n: summed[n] for n, has in zip(self._names, present) if has}, contributors

    def _leader_broadcast(self) -> None:
        """Send the parameters the leader pulled to the site's followers."""
        self.hub.broadcast(flatten(self._flat, self._names), self.step_count)
