"""How a shard accepts a push: validation, BSP/SSP/ASP/local rounds, the optimizer step.

Methods of `hybridfleet.ps.server.shard.ShardState` (mixed in). Decoding runs before the
lock; every verdict is given under it, and a refused push changes nothing.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.frame import read_header
from hybridfleet.codec.rows import RowsCodec
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.aggregate import RoundAggregator, make_round
from hybridfleet.ps.server.groups import ScriptOptimizer, differences, parse_description
from hybridfleet.ps.server.limits import max_encoded_bytes
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.buffers import DTYPE
from hybridfleet.ps.wire.reject import Reject

log = get_logger("ps.shard")
_ROWS = RowsCodec()  # stateless: one instance serves every key

# How far past its last applied step (or the shard's version, after a rejoin) a worker's
# push may claim to be; anything beyond is refused, not recorded as the worker's clock.
STEP_WINDOW = 64
# The highest version an INIT may hand a shard that came back without a snapshot (far below
# uint64's end, so the versions that follow it stay on the wire)
MAX_INIT_VERSION = 1 << 62


class Rounds:
    """Push validation and application of one shard."""

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

    # -------------------------------------------------------------------- push
    def push(self, worker_id: str, site: str, kind: str, step: int, base_version: int, codec: str,
             payloads: dict[str, bytes], contributors: int = 1, optimizer_json: str = "",
             skip_nonfinite: bool = False, take_payloads: bool = False) -> tuple[int, bool]:
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
        as before, after the membership, replay and round checks.

        ``take_payloads``: the caller hands ``payloads`` over (the servers' receive buffers). Once
        a round holds what it needs of an accepted push (its sum adopts the first push's buffer
        and adds the others into it), the dict is emptied, so the buffers of the push that
        closes a round are freed before the round's optimizer step instead of beside it. A
        refused push leaves the dict as it was."""
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
                if base_version > MAX_INIT_VERSION:
                    raise Reject("INVALID_ARGUMENT", f"INIT from worker {worker_id} names version {base_version}; "
                                                     f"at most {MAX_INIT_VERSION}; nothing changed")
                return self._push_init(worker_id, payloads, base_version)
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
                if take_payloads:  # the round keeps what it needs; the rest of this push goes now
                    grads = decoded = None
                    payloads.clear()
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
            if self.sync == "ssp":
                self._wake_pullers("clock")  # this worker's clock moved
            self.cond.notify_all()  # secure aggregation's own waiters (roster, unmasking)
            return self.version, applied

    def _push_init(self, worker_id: str, payloads: dict[str, bytes], base_version: int = 0) -> tuple[int, bool]:
        """Initial values of keys not initialised yet. ``base_version`` above 0 on a shard that holds no
        value and no version (it came back without a snapshot): the values are those of that version
        (the initialising worker's last pull), and the shard goes on from it, so its rounds keep the
        numbers the workers' clocks count in."""
        values = {}
        for key, payload in payloads.items():
            values[key] = self._decode_raw(key, payload)
        if base_version > 0 and self.version == 0 and not self.initialized and values:
            self.version = base_version
            for key in values:
                self.key_version[key] = base_version
            log.warning("shard_initialised_again", shard=self.shard, worker=worker_id, version=base_version)
        fresh = 0
        for key, arr in values.items():
            if key not in self.initialized:
                self._before_values_change([key])
                self.params[key][:] = arr
                self.initialized.add(key)
                if self.compress_down:
                    self.broadcast[key] = self.params[key].copy()
                fresh += 1
        if fresh and self.is_initialized() and self.version == 0:
            self.init_digest = values_digest(self.params[k] for k in self.keys)
        log.info("params_initialized", shard=self.shard, worker=worker_id, keys=fresh)
        if fresh and self.is_initialized():
            self._wake_pullers("init")
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
                if header.codec_name == "rows" and not buffers.is_buffer(key):
                    if job_codec.name != "none":  # workers send touched rows only where the dense frame would be raw
                        raise Reject("INVALID_ARGUMENT", f"key {key!r}: a rows frame is taken only under codec 'none'; "
                                                         f"this job's codec is {job_codec.name!r}")
                    codec = _ROWS  # a row-sparse gradient's touched rows, exact: the dense block they stand for
                if header.dtype != DTYPE or header.shape != (expected,):
                    raise Reject("INVALID_ARGUMENT", f"key {key!r}: frame holds {header.dtype} of shape "
                                                     f"{header.shape}, expected {expected} elements of float32 "
                                                     f"in shape ({expected},)")
                # a raw frame's values stay in the push's own buffer (the round may adopt it), not a copy
                arr = codec.decode(payload, expected_numel=expected, view=True)
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
            self._apply(update, desc, consume=self.secagg is None)  # secure aggregation keeps its update
        return True

    def _skip_round(self, skippers: set[str]) -> None:
        """Close the open round without applying anything: a worker's gradient was not finite."""
        log.warning("round_skipped_nonfinite", shard=self.shard, round=self.version, workers=sorted(skippers))
        self.version += 1
        self.skipped_rounds += 1
        if self.compress_down:
            self._encode_deltas([])  # the delta log stays contiguous: this version changed nothing
        self._published([])
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

    def _apply(self, grads: dict[str, np.ndarray], desc: dict | None = None, consume: bool = False) -> None:
        """Step the keys of ``grads`` (those that had a gradient) with the script's optimizer ``desc``,
        or with the job's ``ps.optimizer``; buffers take the round's sample-weighted statistics.
        ``consume`` (the caller owns ``grads``): with the job's optimizer each key's update is
        removed from ``grads`` once stepped, so a round's sums are freed key by key while the next
        keys' temporaries exist."""
        self._before_values_change(list(grads))  # a pull still sending them keeps the old values
        keys = list(grads)
        for key in keys:
            if buffers.is_buffer(key):  # the round's sample-weighted statistics (see ps.wire.buffers)
                buffers.apply_update(self.params[key], grads[key])
        params = {key: grad for key, grad in grads.items() if not buffers.is_buffer(key)}
        if desc is not None:
            if self.script_optimizer is None:
                self.script_optimizer = self.new_script_optimizer()
            self.script_optimizer.step(self.params, params, desc)
        else:
            for key in list(params):
                if consume:
                    grads.pop(key)
                self.optimizer.step(key, self.params[key], params.pop(key))
        self.version += 1
        for key in keys:
            self.key_version[key] = self.version
        self.applied_pushes += 1
        if self.compress_down:
            self._encode_deltas(keys)
        self._published(keys)
        if self.on_applied is not None:
            self.on_applied()  # e.g. the snapshotter capturing every N versions, under this lock



def values_digest(arrays) -> str:
    """sha256 over float32 arrays in the given order: how a worker and a shard agree on initial values."""
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a, dtype=DTYPE)).cast("B"))  # hashed in place, not copied
    return h.hexdigest()
