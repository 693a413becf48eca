"""One parameter-server shard's state: parameters, optimizer, membership and consistency.

The gRPC layer (`server.py`) only moves bytes; everything that decides whether a
push is valid and when it is applied lives here, behind one lock, so it can be
tested without a network. A rejected push raises `Reject` and changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.codec.frame import read_header
from hybridfleet.ps.aggregate import RoundAggregator, make_round
from hybridfleet.ps.server.groups import ScriptOptimizer, differences, parse_description
from hybridfleet.ps.server.limits import PULL_WAIT_CEILING_S, max_encoded_bytes
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan, matrix_rows
from hybridfleet.ps.wire.protocol import CHUNK_BYTES
from hybridfleet.ps.wire.reject import Reject
from hybridfleet.spec.models import PSSpec
from hybridfleet.spec.rules import ROUND_SYNC_MODES

log = get_logger("ps.shard")

DTYPE = np.dtype("<f4")

# How far past its last applied step (or the shard's version, after a rejoin) a worker's
# push may claim to be; anything beyond is refused, not recorded as the worker's clock.
STEP_WINDOW = 64

# Compressed downlink: how many versions of encoded deltas a shard keeps so a
# worker a few versions behind still gets deltas; further behind, it gets values.
DELTA_LOG_VERSIONS = 64


@dataclass
class Member:
    worker_id: str
    site: str
    last_seen: float
    clock: int = 0          # pushes applied or accepted from this worker
    alive: bool = True
    joins: int = 0          # how often it joined (a rejoin may bring a fresh secure-aggregation key)


class ShardState:
    """Parameters and optimizer state of one shard, with BSP/SSP/ASP consistency."""

    def __init__(self, shard: int, spec: PSSpec, flavour: str = "torch", expected_workers: int = 0,
                 codec: str | None = None, clock=time.monotonic, sites: dict[str, int] | None = None,
                 secagg=None, initialiser: str | None = None):
        """``sites``: each site's worker count from the job; with it a Join must name one of the
        job's worker ids (``<site>-<rank>``, rank below the count) and a push may count at most
        that many contributors. ``secagg``: the job's resolved `SecAggSettings` when
        ``spec.secure_aggregation`` is on (pushes are then masked ring vectors). ``initialiser``:
        the one worker id whose INIT is accepted (`hybridfleet.security.credentials.initialising_worker`;
        None: any member's)."""
        from hybridfleet.ps.server.optim import make_optimizer

        self.shard = shard
        self.spec = spec
        self.sync = spec.sync
        self.in_rounds = spec.sync in ROUND_SYNC_MODES  # local: one round per outer step, like bsp
        self.codec_name = codec or spec.compression.codec
        self.expected_workers = expected_workers
        self.sites = dict(sites) if sites is not None else None
        self.initialiser = initialiser
        self.flavour = flavour
        self.optimizer = make_optimizer(spec.optimizer, flavour)  # the job's ps.optimizer (numpy)
        self.script_optimizer: ScriptOptimizer | None = None     # the script's, made on its first step
        self.round_optimizer: dict[int, tuple[str, dict | None]] = {}  # round -> (first pusher, its optimizer)
        self.plan: ShardingPlan | None = None
        self.params: dict[str, np.ndarray] = {}
        self.key_version: dict[str, int] = {}
        self._wire_cache: dict[str, tuple[int, list[bytes]]] = {}
        self.initialized: set[str] = set()
        self.version = 0
        self.init_digest = ""   # sha256 of the initial values (see values_digest)
        self.members: dict[str, Member] = {}
        self.rounds: dict[int, RoundAggregator] = {}
        self.applied_pushes = 0
        self.rejected_pushes = 0
        self.skipped_rounds = 0  # rounds closed without an update: a worker's gradient was not finite
        self.skipped_pushes = 0  # the same outside rounds (asp, ssp): one worker's update skipped
        self.skip_votes: dict[int, set[str]] = {}  # round -> workers that pushed skip_nonfinite
        self.on_applied: Callable[[], None] | None = None  # called after each applied version, lock held
        self._first_join: float | None = None
        self._now = clock
        self.cond = threading.Condition()
        self._codec = None
        # compressed downlink (codec != none): workers hold `broadcast`, not `params`;
        # each applied version sends codec(params - broadcast) and adds its decoding to
        # `broadcast`, so what the codec dropped stays in the difference and is sent
        # later (error feedback on the server), and every worker holds the same values.
        self.compress_down = self.codec_name != "none"
        self.broadcast: dict[str, np.ndarray] = {}
        self._down_q: dict[str, np.ndarray | None] = {}  # a warm-start codec's Q per key (powersgd downlink)
        # (version, key -> encoded delta cut into wire pieces once, shared by every puller)
        self.delta_log: deque[tuple[int, dict[str, list[bytes]]]] = deque(maxlen=DELTA_LOG_VERSIONS)
        self.downlink_dense_bytes = 0
        self.downlink_encoded_bytes = 0
        if (spec.secure_aggregation is None) != (secagg is None):
            raise ValueError("ShardState: pass the job's SecAggSettings exactly when ps.secure_aggregation is on")
        self.secagg = None
        if secagg is not None:
            from hybridfleet.ps.secagg.server import SecAggServer

            self.secagg = SecAggServer(self, secagg)

    # ----------------------------------------------------------------- helpers
    @property
    def keys(self) -> list[str]:
        return [b.key for b in self.plan.blocks_for_shard(self.shard)] if self.plan else []

    def codec(self):
        if self._codec is None:
            from hybridfleet.codec import codec_for, get_codec

            c = self.spec.compression
            self._codec = codec_for(c) if self.codec_name == c.codec else get_codec(self.codec_name)
        return self._codec

    def live_members(self) -> set[str]:
        return {w for w, m in self.members.items() if m.alive}

    def is_initialized(self) -> bool:
        return self.plan is not None and len(self.initialized) == len(self.keys)

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
            self.cond.notify_all()
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

    def check_push_keys(self, kind: str, keys: list[tuple[str, int]]) -> None:
        """Before any payload byte is read: every declared key belongs to this shard and its byte
        count fits the key (exactly its float32 size for initial values, at most any codec's
        frame of it otherwise). Raises Reject."""
        plan = self.plan
        if plan is None:
            raise Reject("FAILED_PRECONDITION", "no worker has joined this shard yet; call Join first")
        sizes = {b.key: b.stop - b.start for b in plan.blocks_for_shard(self.shard)}
        unknown = sorted({key for key, _ in keys} - set(sizes))
        if unknown:
            raise Reject("INVALID_ARGUMENT", f"unknown key(s) for shard {self.shard}: {', '.join(unknown[:5])}")
        for key, nbytes in keys:
            numel = sizes[key]
            limit = numel * DTYPE.itemsize if kind == "INIT" else max_encoded_bytes(numel)
            if nbytes > limit or (kind == "INIT" and nbytes != limit):
                raise Reject("INVALID_ARGUMENT", f"key {key!r}: push declares {nbytes} bytes; the key holds {numel} "
                                                 f"float32 elements ({'exactly' if kind == 'INIT' else 'at most'} "
                                                 f"{limit} bytes)")

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
            self.cond.notify_all()

    def reap(self) -> list[str]:
        """Drop workers silent longer than the heartbeat timeout from the quorum; returns who was dropped."""
        with self.cond:
            now = self._now()
            dropped = [w for w, m in self.members.items()
                       if m.alive and now - m.last_seen > self.spec.heartbeat_timeout_s]
            for w in dropped:
                self.members[w].alive = False
                log.warning("worker_timed_out", shard=self.shard, worker=w,
                            silent_s=round(now - self.members[w].last_seen, 2))
            if self._maybe_finish_rounds() or dropped:
                self.cond.notify_all()
            return dropped

    def _member(self, worker_id: str) -> Member:
        member = self.members.get(worker_id)
        if member is None:
            raise Reject("FAILED_PRECONDITION", f"worker {worker_id!r} has not joined this shard; call Join first")
        return member

    # -------------------------------------------------------------------- push
    def push(self, worker_id: str, site: str, kind: str, step: int, base_version: int, codec: str,
             payloads: dict[str, bytes], contributors: int = 1, optimizer_json: str = "",
             skip_nonfinite: bool = False) -> tuple[int, bool]:
        """Validate a whole push, then apply it per the consistency mode; nothing changes if it is rejected.

        ``skip_nonfinite``: the worker's gradient was not finite (GradScaler semantics): the push
        carries no key and counts as the worker's part of the round, which then closes without
        applying anything (version + 1, every parameter unchanged; logged as
        ``round_skipped_nonfinite`` and counted in ``status()["skipped_rounds"]``). Outside rounds
        (asp, ssp) only that worker's update is skipped.

        ``optimizer_json``: the script's optimizer for this step (`hybridfleet.ps.server.groups`);
        empty, the job's ``ps.optimizer`` applies. Keys absent from the push had no gradient and
        are not stepped; every push of a round must carry the same optimizer settings.

        Decoding (the costly part of validation) runs before the shard's lock is taken, so
        pushes from several workers decode in parallel; its verdict is given in the same order
        as before, after the membership, replay and round checks."""
        decoded: dict[str, np.ndarray] | Reject | None = None
        if kind != "INIT" and self.plan is not None:
            try:
                decoded = self._decode_masked(payloads) if self.secagg is not None else self._decode_all(payloads)
            except Reject as rej:
                decoded = rej
        desc: dict | Reject | None = None
        if kind != "INIT" and self.plan is not None:
            try:
                desc = parse_description(optimizer_json, self.flavour, set(self.plan.params))
            except Reject as rej:
                desc = rej
        with self.cond:
            member = self._member(worker_id)
            if member.site != site:
                raise Reject("PERMISSION_DENIED", f"token is for site {site!r}, worker {worker_id} is at {member.site!r}")
            if kind == "INIT":
                if self.initialiser is not None and worker_id != self.initialiser:
                    raise Reject("PERMISSION_DENIED", f"worker {worker_id} may not initialise the parameters: the "
                                                      f"job names {self.initialiser} (ps.init_site, else global "
                                                      f"rank 0); nothing changed")
                return self._push_init(worker_id, payloads)
            if not self.is_initialized():
                raise Reject("FAILED_PRECONDITION", "parameters are not initialized yet; pull first")
            most = self.sites.get(member.site, 1) if self.sites is not None else None
            if contributors < 1 or (most is not None and contributors > most):
                raise Reject("INVALID_ARGUMENT", f"push counts {contributors} contributors; site {member.site!r} "
                                                 f"has {most} worker(s)")
            limit = max(member.clock, self.version) + STEP_WINDOW
            if step > limit:
                raise Reject("OUT_OF_RANGE", f"push step {step} is beyond the consistency window (at most {limit}: "
                                             f"last applied step {member.clock}, version {self.version}, "
                                             f"window {STEP_WINDOW}); nothing changed")
            if step <= member.clock:
                self.rejected_pushes += 1
                raise Reject("ALREADY_EXISTS",
                             f"push (worker {worker_id}, step {step}) replays an applied step "
                             f"(last applied step {member.clock}); nothing changed")
            agreed = self.secagg.settings.codec_name if self.secagg is not None else self.codec_name
            if codec != agreed:
                raise Reject("INVALID_ARGUMENT", f"push codec {codec!r} differs from the agreed {agreed!r}")
            if self.in_rounds and base_version != self.version:
                self.rejected_pushes += 1
                raise Reject("FAILED_PRECONDITION",
                             f"stale push: computed on version {base_version}, round {self.version} is open; pull and retry")
            rnd = self.rounds.get(self.version) if self.in_rounds else None
            if rnd is not None and worker_id in rnd.contributors:
                self.rejected_pushes += 1
                raise Reject("ALREADY_EXISTS", f"worker {worker_id} already pushed round {self.version}; "
                                               "wait for the round to close, then pull")
            if skip_nonfinite and payloads:
                raise Reject("INVALID_ARGUMENT", "a push that skips its round (non-finite gradient) carries no "
                                                 f"keys; this one carries {len(payloads)}; nothing changed")
            if skip_nonfinite and self.secagg is not None:
                raise Reject("INVALID_ARGUMENT", "a round cannot be skipped under secure aggregation (the masks "
                                                 "need every worker's masked update); nothing changed")
            if isinstance(decoded, Reject):
                raise decoded
            if isinstance(desc, Reject):
                raise desc
            if self.in_rounds:
                self._check_round_optimizer(worker_id, desc)
            if self.secagg is not None:
                self.secagg.admit_push(worker_id, self.version)
            grads = decoded if decoded is not None else self._decode_all(payloads)
            member.clock = step
            member.last_seen = self._now()
            member.alive = True
            weight = contributors
            if self.in_rounds:
                rnd = self.rounds.get(self.version) or self.rounds.setdefault(self.version, self._new_round())
                rnd.add(worker_id, grads, weight)
                self.round_optimizer.setdefault(self.version, (worker_id, desc))
                if skip_nonfinite:
                    self.skip_votes.setdefault(self.version, set()).add(worker_id)
                applied = self._maybe_finish_rounds()
            elif skip_nonfinite:
                self.skipped_pushes += 1
                log.warning("push_skipped_nonfinite", shard=self.shard, worker=worker_id, step=step,
                            version=self.version)
                applied = False
            else:
                self._apply({k: g / weight if weight > 1 else g for k, g in grads.items()}, desc)
                applied = True
            self.cond.notify_all()
            return self.version, applied

    def _push_init(self, worker_id: str, payloads: dict[str, bytes]) -> tuple[int, bool]:
        values = {}
        for key, payload in payloads.items():
            values[key] = self._decode_raw(key, payload)
        fresh = 0
        for key, arr in values.items():
            if key not in self.initialized:
                self.params[key][:] = arr
                self.initialized.add(key)
                self._wire_cache.pop(key, None)
                if self.compress_down:
                    self.broadcast[key] = self.params[key].copy()
                fresh += 1
        if fresh and self.is_initialized() and self.version == 0:
            self.init_digest = values_digest(self.params[k] for k in self.keys)
        log.info("params_initialized", shard=self.shard, worker=worker_id, keys=fresh)
        self.cond.notify_all()
        return self.version, fresh > 0

    def _expected_keys(self, payloads: dict[str, bytes]) -> None:
        """Every key belongs to this shard; a masked push carries all of them (the masks cover every key),
        a plain one only the keys that had a gradient."""
        keys = set(self.keys)
        unknown = sorted(set(payloads) - keys)
        if unknown:
            raise Reject("INVALID_ARGUMENT", f"unknown key(s) for shard {self.shard}: {', '.join(unknown[:5])}")
        missing = sorted(keys - set(payloads))
        if missing and self.secagg is not None:
            raise Reject("INVALID_ARGUMENT", f"push lacks key(s) of shard {self.shard}: {', '.join(missing[:5])}")

    def _decode_raw(self, key: str, payload: bytes) -> np.ndarray:
        if key not in self.params:
            raise Reject("INVALID_ARGUMENT", f"unknown key {key!r} for shard {self.shard}")
        n = self.params[key].size
        if len(payload) != n * DTYPE.itemsize:
            raise Reject("INVALID_ARGUMENT",
                         f"key {key!r}: {len(payload)} bytes, expected {n * DTYPE.itemsize} (float32 x {n})")
        arr = np.frombuffer(payload, dtype=DTYPE)
        if not np.isfinite(arr).all():
            raise Reject("INVALID_ARGUMENT", f"key {key!r}: non-finite values (NaN or Inf)")
        return arr

    def _new_round(self) -> RoundAggregator:
        if self.secagg is not None:
            from hybridfleet.ps.secagg.server import MaskedRound

            return MaskedRound(self.secagg.settings.bits)
        return make_round(self.spec.aggregate)

    def _decode_masked(self, payloads: dict[str, bytes]) -> dict[str, np.ndarray]:
        self._expected_keys(payloads)
        return self.secagg.decode(self.version, payloads)

    def _decode_all(self, payloads: dict[str, bytes]) -> dict[str, np.ndarray]:
        self._expected_keys(payloads)
        job_codec, dense = self.codec(), buffers.dense_codec()
        out = {}
        for key, payload in payloads.items():
            expected = self.params[key].size
            codec = dense if buffers.is_buffer(key) else job_codec
            try:
                # the frame's header is checked against the key before anything is allocated
                header, _ = read_header(payload, codec.name)
                if header.dtype != DTYPE or header.shape != (expected,):
                    raise Reject("INVALID_ARGUMENT", f"key {key!r}: frame holds {header.dtype} of shape "
                                                     f"{header.shape}, expected {expected} elements of float32 "
                                                     f"in shape ({expected},)")
                arr = codec.decode(payload, expected_numel=expected)
            except ValueError as err:  # ProtocolError subclasses ValueError
                raise Reject("INVALID_ARGUMENT", f"key {key!r}: {err}") from None
            if arr.dtype != DTYPE:
                raise Reject("INVALID_ARGUMENT", f"key {key!r}: dtype {arr.dtype}, expected float32")
            if arr.size != expected:
                raise Reject("INVALID_ARGUMENT",
                             f"key {key!r}: shape {tuple(arr.shape)} ({arr.size} elements), expected {expected} elements")
            out[key] = arr.reshape(-1)  # decode() has checked the values are finite
            refused = buffers.check_update(key, out[key]) if buffers.is_buffer(key) else None
            if refused:
                raise Reject("INVALID_ARGUMENT", refused)
        return out

    def _maybe_finish_rounds(self) -> bool:
        """Apply the open BSP round when every live worker has pushed it."""
        rnd = self.rounds.get(self.version)
        if rnd is None or not rnd.contributors:
            return False
        live = self.live_members() if self.secagg is None else self.secagg.expected(self.live_members())
        if not live <= rnd.contributors:
            return False
        if self.expected_workers and len(self.members) < self.expected_workers:
            waited = self._now() - (self._first_join or self._now())
            if waited < self.spec.heartbeat_timeout_s:
                return False
        if self.secagg is not None:
            update = self.secagg.finish(self.version, rnd)  # None until the survivors answered
            if update is None:
                return False
        else:
            update = rnd.result()
        del self.rounds[self.version]
        _, desc = self.round_optimizer.pop(self.version, (None, None))
        skippers = self.skip_votes.pop(self.version, None)
        if skippers:
            self._skip_round(skippers)
        else:
            self._apply(update, desc)
        return True

    def _skip_round(self, skippers: set[str]) -> None:
        """Close the open round without applying anything: a worker's gradient was not finite."""
        log.warning("round_skipped_nonfinite", shard=self.shard, round=self.version, workers=sorted(skippers))
        self.version += 1
        self.skipped_rounds += 1
        if self.compress_down:
            self._encode_deltas([])  # the delta log stays contiguous: this version changed nothing
        if self.on_applied is not None:
            self.on_applied()

    def _check_round_optimizer(self, worker_id: str, desc: dict | None) -> None:
        """A round's pushers agree on the optimizer and every hyperparameter; Reject names the differences."""
        first = self.round_optimizer.get(self.version)
        if first is None or first[1] == desc:
            return
        other, agreed = first
        if agreed is None or desc is None:
            diff = ["the job's ps.optimizer" if d is None else f"the script's {d['class']}" for d in (desc, agreed)]
            found = [f"{diff[0]} != {diff[1]}"]
        else:
            found = differences(desc, agreed)
        self.rejected_pushes += 1
        raise Reject("INVALID_ARGUMENT", f"worker {worker_id}'s optimizer settings differ from those of {other} in "
                                         f"round {self.version}: {'; '.join(found[:8])}; nothing changed "
                                         "(every worker must build the same optimizer and schedule)")

    def new_script_optimizer(self) -> ScriptOptimizer:
        """A fresh runner of the script's optimizer over this shard's keys (plan fixed)."""
        return ScriptOptimizer(self.flavour, {b.key: b.param for b in self.plan.blocks_for_shard(self.shard)})

    def _apply(self, grads: dict[str, np.ndarray], desc: dict | None = None) -> None:
        """Step the keys of ``grads`` (those that had a gradient) with the script's optimizer ``desc``,
        or with the job's ``ps.optimizer``; buffers take the round's sample-weighted statistics."""
        params = {}
        for key, grad in grads.items():
            if buffers.is_buffer(key):  # the round's sample-weighted statistics (see ps.wire.buffers)
                buffers.apply_update(self.params[key], grad)
            else:
                params[key] = grad
        if desc is not None:
            if self.script_optimizer is None:
                self.script_optimizer = self.new_script_optimizer()
            self.script_optimizer.step(self.params, params, desc)
        else:
            for key, grad in params.items():
                self.optimizer.step(key, self.params[key], grad)
        self.version += 1
        for key in grads:
            self.key_version[key] = self.version
        self.applied_pushes += 1
        if self.compress_down:
            self._encode_deltas(list(grads))
        if self.on_applied is not None:
            self.on_applied()  # e.g. the snapshotter capturing every N versions, under this lock

    def _encode_deltas(self, keys: list[str]) -> None:
        job_codec, dense = self.codec(), buffers.dense_codec()
        deltas = {}
        for key in keys:
            codec = dense if buffers.is_buffer(key) else job_codec
            if getattr(codec, "warm_start", False):  # powersgd: the block in its parameter's rows, Q warm-started
                payload, self._down_q[key] = codec.encode_warm(self.params[key] - self.broadcast[key],
                                                               self._down_q.get(key),
                                                               rows=matrix_rows(self.plan, key))
            else:
                payload = codec.encode(self.params[key] - self.broadcast[key])
            self.broadcast[key] += codec.decode(payload)
            deltas[key] = _pieces(payload)
            self.downlink_dense_bytes += self.params[key].nbytes
            self.downlink_encoded_bytes += len(payload)
        self.delta_log.append((self.version, deltas))

    # -------------------------------------------------------------------- pull
    def pull(self, worker_id: str, since_version: int, wait_for_version: int, worker_clock: int,
             timeout_s: float, init_digest: str = "") -> tuple[int, list[tuple[str, list[bytes], int, int]]]:
        """Wait per the consistency mode, then return ``(version, [(key, chunks, total_bytes, delta_version)])``:
        values (delta_version 0) of the keys changed since ``since_version``, or, with a compressed
        downlink, the encoded deltas of each later version in order."""
        deadline = self._now() + min(max(0.0, timeout_s), PULL_WAIT_CEILING_S)
        with self.cond:
            self._member(worker_id)
            while not self._pull_ready(worker_id, wait_for_version, worker_clock):
                if self.secagg is not None and self.secagg.failed:
                    raise Reject("ABORTED", self.secagg.failed)
                left = deadline - self._now()
                if left <= 0:
                    raise Reject("DEADLINE_EXCEEDED", self._wait_reason(worker_id, wait_for_version, worker_clock))
                self.cond.wait(min(left, 0.5))
                self._maybe_finish_rounds()
            if since_version < 0 and init_digest and init_digest == self.init_digest:
                since_version = 0  # the caller holds the initial values already
            if self.compress_down:
                return self.version, self._pull_compressed(since_version)
            out = [(k, self._wire_chunks(k), self.params[k].nbytes, 0)
                   for k in self.keys if self.key_version[k] > since_version]
            return self.version, out

    def _pull_compressed(self, since_version: int) -> list[tuple[str, list[bytes], int, int]]:
        """Encoded deltas since ``since_version`` in order, or the broadcast values when the log
        does not reach back that far (a new, rejoining or far-behind worker)."""
        if since_version >= 0 and since_version >= self.version:
            return []
        logged = [(v, d) for v, d in self.delta_log if v > since_version]
        if since_version >= 0 and logged and logged[0][0] == since_version + 1:
            return [(k, pieces, sum(len(p) for p in pieces), v) for v, d in logged for k, pieces in d.items()]
        return [(k, self._wire_chunks(k), self.broadcast[k].nbytes, 0) for k in self.keys]

    def _wire_chunks(self, key: str) -> list[bytes]:
        """The key's current values as wire-sized pieces, copied once per version and shared by every puller."""
        cached = self._wire_cache.get(key)
        if cached is not None and cached[0] == self.key_version[key]:
            return cached[1]
        chunks = _pieces((self.broadcast if self.compress_down else self.params)[key])
        self._wire_cache[key] = (self.key_version[key], chunks)
        return chunks

    def _pull_ready(self, worker_id: str, wait_for_version: int, worker_clock: int) -> bool:
        if not self.is_initialized():
            return False
        if wait_for_version >= 0 and self.version < wait_for_version:
            return False
        if self.sync == "ssp":
            live = [m.clock for m in self.members.values() if m.alive and m.worker_id != worker_id]
            if live and worker_clock - min(live) > self.spec.staleness_bound:
                return False
        return True

    def _wait_reason(self, worker_id: str, wait_for_version: int, worker_clock: int) -> str:
        if not self.is_initialized():
            return "parameters not initialized yet"
        if self.version < wait_for_version:
            rnd = self.rounds.get(self.version)
            have = sorted(rnd.contributors) if rnd else []
            return f"round {self.version} waits for {sorted(self.live_members() - set(have))}"
        return f"worker {worker_id} at clock {worker_clock} is more than {self.spec.staleness_bound} steps ahead"

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        with self.cond:
            return {
                "shard": self.shard, "version": self.version, "sync": self.sync, "codec": self.codec_name,
                "keys": len(self.keys), "initialized": self.is_initialized(),
                "param_bytes": int(sum(p.nbytes for p in self.params.values())),
                "live_workers": sorted(self.live_members()),
                "members": {w: {"site": m.site, "clock": m.clock, "alive": m.alive} for w, m in self.members.items()},
                "applied_pushes": self.applied_pushes, "rejected_pushes": self.rejected_pushes,
                "skipped_rounds": self.skipped_rounds, "skipped_pushes": self.skipped_pushes,
                "downlink_dense_bytes": self.downlink_dense_bytes,
                "downlink_encoded_bytes": self.downlink_encoded_bytes,
                **({"secure_aggregation": self.secagg.status()} if self.secagg is not None else {}),
            }

    def snapshot_arrays(self) -> dict[str, np.ndarray]:
        """A copy of the parameters (for tests and snapshots)."""
        with self.cond:
            return {k: v.copy() for k, v in self.params.items()}


def _shape_of(plan: ShardingPlan, name: str) -> str:
    spec = plan.params.get(name)
    return "absent" if spec is None else str(spec.shape)


def _pieces(data: np.ndarray | bytes) -> list[bytes]:
    """``data`` cut into wire-sized pieces (one copy)."""
    if isinstance(data, np.ndarray):
        step = CHUNK_BYTES // data.itemsize
        return [data[i:i + step].tobytes() for i in range(0, max(data.size, 1), step)]
    return [data[i:i + CHUNK_BYTES] for i in range(0, max(len(data), 1), CHUNK_BYTES)]


def values_digest(arrays) -> str:
    """sha256 over float32 arrays in the given order: how a worker and a shard agree on initial values."""
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=DTYPE).tobytes())
    return h.hexdigest()
