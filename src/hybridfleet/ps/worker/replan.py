"""A worker carries on when the job's shard count changes while it trains (`hfleet ps scale`).

The launcher stops every shard at a round boundary (each writes a final snapshot), re-cuts
the snapshots for the new count (`hybridfleet.ps.server.handover`), names the new count in
``<port dir>/shards.json`` (`hybridfleet.ps.worker.resolve.write_plan`) and starts the new
shards, which write their ``shard-<i>.port`` files. A worker's next failing call sees the
new plan generation (`PSClient` raises `PlanChanged`); the worker then joins the new shards
with a new client and learns the new plan. Their version ``V`` against the base version ``b``
of the push in flight says what they hold of it:

- ``V == b``: the push is not in the re-cut state; the same encoded blocks (block keys do not
  depend on the shard count) go to the new shards, same step: the round closes as it would have;
- ``V == b + 1``: the push was applied before the stop; the worker pulls every value in full;
- otherwise (not possible when every shard wrote its final snapshot): this step's gradient is
  dropped and training goes on from the new shards' values (logged ``plan_changed_gradient_dropped``).
"""

from __future__ import annotations

import time

from hybridfleet.errors import ProtocolError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.worker.client import PlanChanged
from hybridfleet.ps.worker.resolve import current_plan, port_file_resolver, shard_retry_s

log = get_logger("ps.worker")


def wait_for_servers(directory: str, shards: int, timeout_s: float) -> list[str]:
    """The addresses of shards ``0..shards-1`` once every one's port file names one; ProtocolError
    naming the missing shards after ``timeout_s``."""
    resolve = port_file_resolver(directory)
    deadline = time.monotonic() + timeout_s
    while True:
        found = [resolve(i) for i in range(shards)]
        if all(found):
            return found
        if time.monotonic() >= deadline:
            missing = [i for i, a in enumerate(found) if not a]
            raise ProtocolError(f"the job's shard count changed to {shards}, but shard(s) {missing} named no "
                                f"address in {directory} within {timeout_s:.0f} s")
        time.sleep(0.05)


def current_servers(config) -> list[str] | None:
    """The shard addresses a starting worker joins: those of the plan file when the job's shard
    count was changed while it trained, else None (the addresses it was given hold)."""
    directory = config.shard_port_dir
    if not directory:
        return None
    generation, shards = current_plan(directory)
    if not generation or not shards:
        return None
    return wait_for_servers(directory, shards, shard_retry_s())


class NewPlan:
    """The part of `hybridfleet.ps.worker.session.PSSession` that follows a changed shard count."""

    def _join_new_plan(self, changed: PlanChanged) -> int:
        """Join the new shards of ``changed`` with a new client (this client's clock and byte counters
        carried over); returns their version."""
        old = self.client
        servers = wait_for_servers(self.config.shard_port_dir, changed.shards, old.retry_timeout_s)
        old.close(leave=False)
        client = self._new_client(servers)
        client.plan_generation = changed.generation  # a newer change still raises PlanChanged at the next failure
        client.bytes = old.bytes
        info = client.join(*old._join_args)
        client.clock = max(client.clock, old.clock)
        self.client, self.plan = client, client.plan
        version = max(info["versions"])
        log.info("plan_changed", worker=self.config.worker_id, shards=changed.shards, generation=changed.generation,
                 version=version, clock=client.clock)
        return version

    def _carry_on_new_plan(self, changed: PlanChanged, payloads: dict, base: list[int], wait_round: bool,
                           settled: bool, contributors: int, optimizer_json: str, skip_nonfinite: bool) -> None:
        """Finish this step on the shards of a changed shard count (see the module's table)."""
        if self.secure is not None:
            raise ProtocolError("the job's shard count changed under secure aggregation, whose masks are cut "
                                "for the old shards; restart the workers")
        pushed = min(base)  # the base version of the push in flight (BSP: every shard's)
        while True:
            try:
                version = self._join_new_plan(changed)
                shards = self.plan.num_shards
                if version == pushed:
                    self.client.push(payloads, codec=self.codec_name, base_versions=[version] * shards,
                                     contributors=contributors, optimizer_json=optimizer_json,
                                     skip_nonfinite=skip_nonfinite, again=True)
                    log.info("pushed_again", worker=self.config.worker_id, shards=shards, version=version)
                if version in (pushed, pushed + 1):
                    if not settled:
                        self._settle_feedback(applied=True)
                        settled = True
                    self.step_count = self.client.clock
                    self._wait_and_pull([pushed] * shards, wait_round, full=True)
                    return
                if not settled:
                    self._settle_feedback(applied=False)
                    settled = True
                log.warning("plan_changed_gradient_dropped", worker=self.config.worker_id, version=version,
                            base_version=pushed)
                self.step_count = self.client.clock
                self._apply_pulled(self.client.pull(full=True))
                return
            except PlanChanged as again:  # changed again before this step finished
                changed = again
