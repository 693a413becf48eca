"""A shard's quorum: who joined, from which site, who is alive; the first join fixes the plan.

Methods of `hybridfleet.ps.server.shard.ShardState` (mixed in); each takes the shard's
lock itself and raises `Reject` without changing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.buffers import DTYPE
from hybridfleet.ps.wire.reject import Reject
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan

log = get_logger("ps.shard")


@dataclass
class Member:
    worker_id: str
    site: str
    last_seen: float
    clock: int = 0          # pushes applied or accepted from this worker
    alive: bool = True
    joins: int = 0          # how often it joined (a rejoin may bring a fresh secure-aggregation key)



class Membership:
    """Join, heartbeat, leave and reaping of one shard's workers."""

    def live_members(self) -> set[str]:
        return {w for w, m in self.members.items() if m.alive}

    # -------------------------------------------------------------- membership
    def join(self, worker_id: str, site: str, params: list[ParamSpec], num_shards: int,
             block_size_bytes: int, codec: str) -> dict:
        """Register (or re-register) a worker; the first join fixes the sharding plan."""
        if codec != self.codec_name:
            raise Reject("FAILED_PRECONDITION",
                         f"codec {codec!r} does not match this job's codec {self.codec_name!r}")
        if num_shards != self.spec.shards:  # before any state changes: the worker was given too few or too many addresses
            raise Reject("INVALID_ARGUMENT", f"the job has {self.spec.shards} shard(s) but the worker was given "
                                             f"{num_shards} shard address(es); expected {self.spec.shards}")
        try:
            self.codec()
        except ValueError as err:
            raise Reject("INVALID_ARGUMENT", str(err)) from None
        self._check_worker_id(worker_id, site)
        self._check_model(params, num_shards, block_size_bytes)
        plan = ShardingPlan.build(params, num_shards, block_size_bytes)
        with self.cond:
            if self.plan is None:
                self.plan = plan
                for b in plan.blocks_for_shard(self.shard):
                    self.params[b.key] = np.zeros(b.stop - b.start, dtype=DTYPE)
                    self.key_version[b.key] = 0
                log.info("plan_fixed", shard=self.shard, keys=len(self.keys), digest=plan.digest())
            elif plan.digest() != self.plan.digest():
                differ = sorted(n for n in set(plan.params) | set(self.plan.params)
                                if plan.params.get(n) != self.plan.params.get(n))
                shown = "; ".join(f"{n}: {_shape_of(plan, n)} here, {_shape_of(self.plan, n)} in the job"
                                  for n in differ[:3])
                raise Reject("FAILED_PRECONDITION",
                             f"worker {worker_id}: its model's parameters or shard count differ from the job's "
                             f"(plan digest {plan.digest()[:12]} != {self.plan.digest()[:12]})"
                             + (f": {shown}" if shown else ""))
            now = self._now()
            if self._first_join is None:
                self._first_join = now
            member = self.members.get(worker_id)
            if member is None:
                member = self.members[worker_id] = Member(worker_id, site, now)
            elif member.site != site:
                raise Reject("PERMISSION_DENIED", f"worker {worker_id} belongs to site {member.site!r}, not {site!r}")
            rejoined = not member.alive
            member.alive, member.last_seen = True, now
            member.joins += 1
            log.info("worker_joined", shard=self.shard, worker=worker_id, site=site, rejoin=rejoined,
                     live=len(self.live_members()))
            self._maybe_finish_rounds()
            self._wake_pullers("clock")  # ssp: the slowest live clock may have changed
            self.cond.notify_all()  # secure aggregation's roster waiters
            return {"plan": self.plan, "version": self.version, "initialized": self.is_initialized(),
                    "worker_clock": member.clock, "live": sorted(self.live_members())}

    def _check_worker_id(self, worker_id: str, site: str) -> None:
        if self.sites is None:
            return
        if site not in self.sites:
            raise Reject("PERMISSION_DENIED", f"site {site!r} is not a site of this job ({', '.join(self.sites)})")
        prefix = f"{site}-"
        rank = worker_id[len(prefix):] if worker_id.startswith(prefix) else ""
        if not (rank.isdigit() and rank == str(int(rank)) and int(rank) < self.sites[site]):
            raise Reject("PERMISSION_DENIED", f"worker id {worker_id!r} is not one of site {site!r}'s "
                                              f"{self.sites[site]} worker(s) ({prefix}0..{prefix}{self.sites[site] - 1})")

    def _check_model(self, params: list[ParamSpec], num_shards: int, block_size_bytes: int) -> None:
        """The job, not the joiner, sets the plan's shape: shard count, block size and caps."""
        spec = self.spec
        if block_size_bytes != spec.block_size_bytes:
            raise Reject("FAILED_PRECONDITION", f"join asks for blocks of {block_size_bytes} bytes; this job's "
                                                f"ps.block_size_bytes is {spec.block_size_bytes}")
        if len(params) > spec.max_tensors:
            raise Reject("RESOURCE_EXHAUSTED", f"join declares {len(params)} tensors; this job allows at most "
                                               f"{spec.max_tensors} (ps.max_tensors)")
        stored = [p.name for p in params if p.dtype != "float32"]
        if stored:  # the caps below are computed for the declared dtype; the shard stores float32 only
            raise Reject("INVALID_ARGUMENT", f"join declares parameter {stored[0]!r} as "
                                             f"{next(p.dtype for p in params if p.name == stored[0])}; the shards "
                                             f"store float32 values only (declare every parameter as float32)")
        total = sum(p.nbytes for p in params)
        if total > spec.max_model_bytes:
            raise Reject("RESOURCE_EXHAUSTED", f"join declares a model of {total} bytes; this job allows at most "
                                               f"{spec.max_model_bytes} (ps.max_model_bytes)")
        unfit = buffers.check_buffer_blocks(params, block_size_bytes)
        if unfit is None and self.secagg is not None and any(buffers.is_buffer(p.name) for p in params):
            unfit = "buffers to average, which secure aggregation would not mask; set ps.buffers: local"
        if unfit:
            raise Reject("INVALID_ARGUMENT", f"join declares {unfit}")

    def heartbeat(self, worker_id: str) -> None:
        with self.cond:
            member = self._member(worker_id)
            member.last_seen = self._now()
            if not member.alive:
                raise Reject("FAILED_PRECONDITION", f"worker {worker_id} timed out of the quorum; join again")

    def leave(self, worker_id: str) -> None:
        with self.cond:
            member = self._member(worker_id)
            member.alive = False
            log.info("worker_left", shard=self.shard, worker=worker_id)
            self._maybe_finish_rounds()
            self._wake_pullers("clock")
            self.cond.notify_all()

    def reap(self, busy=()) -> list[str]:
        """Drop workers silent longer than the heartbeat timeout from the quorum; returns who was dropped.
        ``busy``: workers the bulk plane is serving now (a push arriving, a pull waiting on an open
        connection); they count as heard from now."""
        with self.cond:
            now = self._now()
            for w in busy:
                member = self.members.get(w)
                if member is not None and member.alive:
                    member.last_seen = now
            dropped = [w for w, m in self.members.items()
                       if m.alive and now - m.last_seen > self.spec.heartbeat_timeout_s]
            for w in dropped:
                self.members[w].alive = False
                log.warning("worker_timed_out", shard=self.shard, worker=w,
                            silent_s=round(now - self.members[w].last_seen, 2))
            if self._maybe_finish_rounds() or dropped:
                self._wake_pullers("clock")
                self.cond.notify_all()
            return dropped

    def _member(self, worker_id: str) -> Member:
        member = self.members.get(worker_id)
        if member is None:
            raise Reject("FAILED_PRECONDITION", f"worker {worker_id!r} has not joined this shard; call Join first")
        return member


def _shape_of(plan: ShardingPlan, name: str) -> str:
    spec = plan.params.get(name)
    return "absent" if spec is None else str(spec.shape)


