"""The exchange with the shards: encode (with error feedback), push, wait per the consistency mode,
pull, and apply the pulled values or deltas in place.

`ShardExchange` is one part of `hybridfleet.ps.worker.session.PSSession`; it works on the
session's parameters (``_flat``), plan and client.
"""

from __future__ import annotations

import grpc
import numpy as np

from hybridfleet.codec.rows import RowsCodec
from hybridfleet.errors import SECURE_ROUND_HINT, ProtocolError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.sharding import matrix_rows
from hybridfleet.ps.worker.client import PlanChanged, Pulled, ShardRestarted
from hybridfleet.ps.worker.replan import NewPlan
from hybridfleet.spec.rules import ROUND_SYNC_MODES
from hybridfleet.ps.wire.buffers import DTYPE  # the wire's float32, little-endian

log = get_logger("ps.worker")
_ROWS = RowsCodec()  # stateless: one instance serves every key
MAX_RECOVERIES = 8  # shards coming back (or connections lost) in a row within one step before it fails


class _Recovery:
    """What a step's recovery knows and has done so far: each shard that came back with the
    version it answered (the latest), the shards this step's push went to again (or that said
    they hold it), whether every shard that came back is one of the plan's, and whether the
    push's error feedback is settled."""

    def __init__(self, settled: bool, clock: int = 0, present: set[str] | None = None):
        self.settled = settled
        self.clock = clock        # this worker's clock once the step is pushed
        self.present = present    # under secure aggregation: the parameters with a gradient (None: all)
        self.versions: dict[int, int] = {}
        self.pushed_again: set[int] = set()
        self.known = True

    def came_back(self, restarted: ShardRestarted, shards: int) -> list[ShardRestarted]:
        """Take in the shards of ``restarted``; returns those of the plan."""
        events = restarted.every()
        inside = [e for e in events if 0 <= e.shard < shards]
        self.known = self.known and len(inside) == len(events)
        for e in inside:
            self.versions[e.shard] = e.version
            self.pushed_again.discard(e.shard)  # back again: what it holds is in its new answer
        return inside



class ShardExchange(NewPlan):
    """Push a step's update to the shards and bring back the parameters to train on next."""

    def _shard_digests(self) -> list[str]:
        from hybridfleet.ps.server.shard import values_digest

        return [values_digest(self._flat[b.param][b.start:b.stop] for b in self.plan.blocks_for_shard(i))
                for i in range(self.plan.num_shards)]

    def _exchange(self, grads: dict[str, np.ndarray], contributors: int, nonfinite: list[str],
                  optimizer_json: str, present: set[str] | None = None,
                  staged: dict[str, tuple[np.ndarray, dict[str, bytes]]] | None = None) -> None:
        """Push ``grads`` (the sum of ``contributors`` workers' gradients), wait as the consistency mode
        says and apply the pulled parameters; a restarted shard's values replace ours. ``present``:
        under secure aggregation, the parameters that had a gradient (the others carry zeros).
        ``staged``: blocks encoded during backward (see `_encode`)."""
        payloads = self._encode(grads, staged) if self.secure is None else self._blocks_of(grads)
        self.timer.mark("encode")
        base = list(self.client.versions)
        clock = self.client.clock + 1  # a push moves it, once a step
        wait_round = self.client.sync in ROUND_SYNC_MODES
        settled = stale = False
        try:
            try:
                if self.secure is not None:  # masked: the shard sees only the round's sum
                    try:
                        self.secure.push(payloads, base, contributors, optimizer_json, present)
                    except grpc.RpcError as err:
                        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                            raise  # already pushed (a retried push): the round still needs our answer
                    self.secure.unmask(base)
                else:
                    self.client.push(payloads, codec=self.codec_name, base_versions=base, contributors=contributors,
                                     optimizer_json=optimizer_json, skip_nonfinite=bool(nonfinite))
                self._settle_feedback(applied=True)
                settled = True
            except grpc.RpcError as err:
                # already pushed this round (a retry of this very push): ours is in the round; anything else
                # (a stale round, an error): not applied, so the residual stays as it was before encoding
                self._settle_feedback(applied=err.code() == grpc.StatusCode.ALREADY_EXISTS)
                settled = True
                if err.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                    raise
                # stale round (after a rejoin): catch up now; already pushed this round: wait for it to close
                stale = err.code() == grpc.StatusCode.FAILED_PRECONDITION
                wait_round = wait_round and not stale
                log.warning("push_skipped", worker=self.config.worker_id, detail=err.details())
            except (ShardRestarted, PlanChanged):
                raise  # settled below, by what the restored (or re-cut) shards hold
            except BaseException:
                self._settle_feedback(applied=False)
                raise
            self.timer.mark("transfer")
            self.step_count = self.client.clock
            self._wait_and_pull(base, wait_round)
            if stale:
                self._take_up_open_round()
        except ShardRestarted as restarted:
            self._recover(restarted, payloads, base, wait_round, _Recovery(settled, clock, present), contributors,
                          optimizer_json, bool(nonfinite))
        except PlanChanged as changed:
            self._carry_on_new_plan(changed, payloads, base, wait_round, settled, contributors, optimizer_json,
                                    bool(nonfinite))
        self.timer.mark("wait")

    def _take_up_open_round(self) -> None:
        """After a push refused as stale, count this worker's steps from the round the shards hold open, as
        a joining worker does: the rounds it missed closed without it (`caught_up` counts them)."""
        if self.client.sync not in ROUND_SYNC_MODES:
            return
        open_round = max(self.client.versions)
        if open_round > self.client.clock:
            self.caught_up += open_round - self.client.clock
            log.info("caught_up", worker=self.config.worker_id, rounds=open_round - self.client.clock,
                     open_round=open_round)
            self.client.clock = open_round
        self.step_count = self.client.clock

    def _wait_and_pull(self, base: list[int], wait_round: bool, full: bool = False) -> None:
        """Pull, waiting (rounds) for each shard holding keys to close the round after ``base``;
        ``full``: every value, not only what changed since this client's versions."""
        wait = None
        if wait_round:
            shards_with_keys = {b.shard for b in self.plan.blocks}
            wait = [v + 1 if i in shards_with_keys else -1 for i, v in enumerate(base)]
        try:
            self._apply_pulled(self.client.pull(wait_for_versions=wait, into=self._pull_target, full=full))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.ABORTED:  # e.g. a secure round that cannot be unmasked
                raise ProtocolError(err.details(), hint=SECURE_ROUND_HINT) from None
            raise

    def _recover(self, restarted: ShardRestarted, payloads: dict, base: list[int], wait_round: bool,
                 step: _Recovery, contributors: int, optimizer_json: str, skip_nonfinite: bool) -> None:
        """Carry on after a shard came back from a snapshot (restarted, or replaced at a new address),
        or answered a Join after the connection to it was lost; again as often as that happens
        while recovering (up to `MAX_RECOVERIES` times in one step), each time from what the shard
        that came back last holds (`_recover_once`)."""
        for _ in range(MAX_RECOVERIES):
            try:
                self._recover_once(restarted, step, payloads, base, wait_round, contributors, optimizer_json,
                                   skip_nonfinite)
                return
            except ShardRestarted as again:
                log.warning("shard_came_back_while_recovering", worker=self.config.worker_id, shard=again.shard,
                            version=again.version)
                restarted = again
        raise ProtocolError(f"the shards came back {MAX_RECOVERIES} times during one step (last: {restarted}); "
                            "the connection to them keeps failing")

    def _recover_once(self, restarted: ShardRestarted, step: _Recovery, payloads: dict, base: list[int],
                      wait_round: bool, contributors: int, optimizer_json: str, skip_nonfinite: bool) -> None:
        """The restored shard's version says what it holds of this step's push: at the push's base
        version the push is not in it and goes to that shard again, same step, same bytes (the
        round is then the one the other shards closed: BSP stays exact), unless the shard answers
        that it holds it already (it never restarted: only the answer to the push was lost); above
        it the push was applied before the snapshot. Either way the step waits for its round as
        usual, and where rounds closed without this worker meanwhile (a shard that never restarted
        answers the Join too, when only the connection was lost during a catch-up) it takes up the
        round now open. Below it (an older snapshot) the shard lost applied rounds: this step's
        gradient is dropped and training goes on from the restored values (not the values an
        uninterrupted run would hold). A shard that came back without any snapshot holds no
        parameters: the worker that initialises the job gives it its values of the shard's blocks
        and their version (its last pull, the push's base), and every worker goes on as from a
        snapshot of that version; the shard's optimizer state starts again. Raises ShardRestarted
        when a shard comes back again meanwhile."""
        events = step.came_back(restarted, len(base))
        empty = [e.shard for e in events if not e.initialized]
        for shard in empty:
            self._initialise_again(shard, base[shard])
        if empty:
            self._apply_pulled(self.client.pull(full=True))  # waits for the initialising worker's values
            step.versions.update({shard: self.client.versions[shard] for shard in empty})
        if self.secure is not None:
            self._recover_secure(restarted, step, payloads, base, wait_round, contributors, optimizer_json)
            return
        known = step.known and bool(step.versions)
        versions = step.versions
        for shard, version in sorted(versions.items()):
            if not known or version != base[shard] or shard in step.pushed_again:
                continue
            try:
                self.client.push(payloads, codec=self.codec_name, base_versions=base, contributors=contributors,
                                 optimizer_json=optimizer_json, skip_nonfinite=skip_nonfinite, only_shard=shard)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                    log.warning("repush_failed", worker=self.config.worker_id, shard=shard, detail=str(err))
                    known = False
                    continue
                log.info("push_already_in_round", worker=self.config.worker_id, shard=shard, version=version)
            else:
                log.info("pushed_again", worker=self.config.worker_id, shard=shard, version=version)
            step.pushed_again.add(shard)
        if known and all(version >= base[shard] for shard, version in versions.items()):
            self._recovered(step, base, wait_round)
            return
        self._drop_step(step, restarted)

    def _recovered(self, step: _Recovery, base: list[int], wait_round: bool) -> None:
        """The step's push is in every shard's round (or applied there): wait for the rounds as usual."""
        if not step.settled:
            self._settle_feedback(applied=True)
            step.settled = True
        self.step_count = self.client.clock
        # in full: a pull the restart cut short may have advanced another shard's version
        # without its values reaching the parameters
        self._wait_and_pull(base, wait_round, full=True)
        # rounds may have closed without this worker meanwhile (its push was stale, or it was
        # dropped while the connection was down): count its steps from the round now open
        self._take_up_open_round()

    def _drop_step(self, step: _Recovery, restarted: ShardRestarted) -> None:
        """This step's gradient is dropped; train on from the restored shard's values. A residual
        committed with a push the restored shard no longer holds is not rolled back (the shard lost
        the values it was applied to as well); one still staged is discarded."""
        if not step.settled:
            self._settle_feedback(applied=False)
            step.settled = True
        log.warning("shard_restarted", worker=self.config.worker_id, detail=str(restarted))
        self.step_count = self.client.clock
        self._apply_pulled(self.client.pull(full=True))
        self._take_up_open_round()  # a re-push refused as stale: the round moved on without this worker

    def _recover_secure(self, restarted: ShardRestarted, step: _Recovery, grads: dict, base: list[int],
                        wait_round: bool, contributors: int, optimizer_json: str) -> None:
        """`_recover_once` under secure aggregation: every shard holding the step's round open (it stayed
        up, lost only the connection, or came back from a snapshot of that round) gets the step's
        masked push and this worker's unmask answer, each once (`SecureRounds.finish`); a round is
        unmasked only with every pusher's answer, so a step given up at one shard would leave that
        round to fail for lack of it. Where a shard lost applied rounds (an older snapshot), or
        refuses the push as stale (its round closed without this worker), the step is dropped as
        without secure aggregation."""
        versions = step.versions
        if step.known and all(version >= base[shard] for shard, version in versions.items()):
            redo = sorted(i for i in {b.shard for b in self.plan.blocks} if versions.get(i, base[i]) == base[i])
            self.client.clock = max(self.client.clock, step.clock)  # the push may not have gone out at all
            try:
                self.secure.finish(grads, base, contributors, optimizer_json, step.present, redo)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                log.warning("push_skipped", worker=self.config.worker_id, detail=err.details())
            else:
                self._recovered(step, base, wait_round)
                return
        self._drop_step(step, restarted)

    def _first_values(self, init: dict | None) -> None:
        """The start: push the job's initial values ``init`` (the worker that initialises the job,
        when the shards hold none yet), then pull every value (only what differs from ours where
        ours are the job's initial values). A shard that comes back meanwhile (a lost connection
        answers a Join as well) is pulled from again; one back without parameters gets them again
        from the initialising worker (`_initialise_again`)."""
        for _ in range(MAX_RECOVERIES):
            try:
                if init is not None:
                    self.client.push(init, codec="none", kind="INIT")
                    init = None
                self._apply_pulled(self.client.pull(full=True, init_digests=self._shard_digests(),
                                                    into=self._pull_target))
                return
            except ShardRestarted as restarted:
                log.warning("shard_came_back_while_starting", worker=self.config.worker_id,
                            shards=[e.shard for e in restarted.every()])
                init = None  # what each shard holds now is in its answer: one without values gets ours again
                for e in restarted.every():
                    if not e.initialized and 0 <= e.shard < self.plan.num_shards:
                        self._initialise_again(e.shard, max(e.version, 0))
        raise ProtocolError(f"the shards came back {MAX_RECOVERIES} times while this worker started; "
                            "the connection to them keeps failing")

    def _initialise_again(self, shard: int, version: int) -> None:
        """Give shard ``shard``, back without a snapshot, this worker's values of its blocks, those of
        ``version`` (only the worker that initialises the job does; the others' pulls wait for them).
        Its optimizer state (the script's, or the job's ``ps.optimizer``) starts again from nothing."""
        if not self.config.initialises:
            return
        init = {b.key: memoryview(self._flat[b.param][b.start:b.stop]).cast("B") for b in self.plan.blocks_for_shard(shard)}
        self.client.push(init, codec="none", kind="INIT", only_shard=shard,
                         base_versions=[max(version, 0) if i == shard else 0 for i in range(self.plan.num_shards)])
        log.warning("shard_initialised_again", worker=self.config.worker_id, shard=shard, keys=len(init), version=version,
                    detail="the shard came back without a snapshot: it holds this worker's current values, and its "
                           "optimizer state starts again")  # fmt: skip

    def _encode(self, grads: dict[str, np.ndarray],
                staged: dict[str, tuple[np.ndarray, dict[str, bytes]]] | None = None) -> dict[str, bytes]:
        """Every block of ``grads``, encoded. ``staged``: name -> (the array the background stage encoded,
        its blocks); a name whose gradient here is that very array takes its blocks as they are (their
        error feedback is staged already); every other staged error-feedback state is discarded, so
        what is staged is exactly what this push carries."""
        out = {}
        for name, g in grads.items():
            pre = staged.get(name) if staged else None
            out.update(pre[1] if pre is not None and pre[0] is g else self.encode_param(name, g))
        if self.feedback is not None:
            self.feedback.keep_staged(out)
        return out

    def encode_param(self, name: str, grad: np.ndarray) -> dict[str, bytes]:
        """One parameter's (or buffer's) update cut into the plan's blocks and encoded: key -> payload.
        With error feedback the residuals are staged until the push is settled."""
        if self._encoder is None:
            self._encoder = self._make_encoder()
        dense = buffers.is_buffer(name)  # buffers travel dense, without error feedback (see ps.wire.buffers)
        # a row-sparse gradient (an embedding built with sparse=True) under codec none: only the
        # touched rows' runs travel, exactly (see hybridfleet.codec.rows)
        encode = (buffers.dense_codec().encode if dense
                  else _ROWS.encode if name in self.row_sparse and self.codec_name == "none"
                  else None)
        return {key: encode(part) if encode is not None else self._encoder(key, part)
                for key, part in self.plan.split(name, np.asarray(grad, dtype=DTYPE).reshape(-1)).items()}

    def _blocks_of(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The update cut into the plan's blocks (key -> float32), unencoded: secure aggregation masks them."""
        out = {}
        for name, g in grads.items():
            out.update(self.plan.split(name, np.asarray(g, dtype=DTYPE).reshape(-1)))
        return out

    def _make_encoder(self):
        """``encode(key, block) -> bytes``; with error feedback the residual stays here, on the worker,
        staged until the push is settled (see `_settle_feedback`)."""
        from hybridfleet.codec import codec_for

        c = self.ps.compression
        codec = codec_for(c)
        if c.error_feedback and self.codec_name != "none":
            from hybridfleet.codec.feedback import ErrorFeedback

            self.feedback = ErrorFeedback(codec, momentum=c.momentum, warmup_steps=c.warmup_steps)
            if getattr(codec, "warm_start", False):  # powersgd: each block in its parameter's own rows
                return lambda key, block: self.feedback.encode(key, block, stage=True,
                                                               rows=matrix_rows(self.plan, key))
            return lambda key, block: self.feedback.encode(key, block, stage=True)
        # a raw block is sent from the gradient's own memory (no frame copy of the model per step)
        return lambda key, block: codec.encode_parts(block)

    def _settle_feedback(self, applied: bool) -> None:
        """Commit the residuals of this push's encoding when the push was applied, else restore
        them to what they were before it (nothing the codec dropped is lost with a refused push)."""
        for holder in (self.feedback, self.secure):
            if holder is not None:
                holder.commit() if applied else holder.discard()

    def _pull_target(self, key: str, delta_version: int, nbytes: int) -> memoryview | None:
        """Where a pulled block's values can be received in place: its slice of the parameters."""
        b = self._blocks().get(key)
        if b is None or delta_version or nbytes != (b.stop - b.start) * DTYPE.itemsize:
            return None  # checked (and refused) by _apply_pulled
        return memoryview(self._flat[b.param][b.start:b.stop]).cast("B")

    def _blocks(self) -> dict:
        if self._block_index is None or self._block_index[0] is not self.plan:
            self._block_index = (self.plan, {b.key: b for b in self.plan.blocks})
        return self._block_index[1]

    def _apply_pulled(self, pulled: list[Pulled]) -> None:
        """Copy pulled values into place, or add decoded deltas (compressed downlink), in order."""
        blocks = self._blocks()
        for entry in pulled:
            b = blocks.get(entry.key)
            if b is None:
                raise ProtocolError(f"pulled unknown key {entry.key!r}")
            if entry.placed:
                continue  # received straight into its slice (see _pull_target)
            dest = self._flat[b.param]
            if entry.delta_version:
                codec = buffers.dense_codec() if buffers.is_buffer(b.param) else self._downlink_codec()
                delta = codec.decode(entry.payload()).reshape(-1)
                if delta.size != b.stop - b.start:
                    raise ProtocolError(f"pulled a delta of {delta.size} elements for {b.key!r}, "
                                        f"expected {b.stop - b.start}")
                dest[b.start:b.stop] += delta
                continue
            if entry.nbytes != (b.stop - b.start) * DTYPE.itemsize:
                raise ProtocolError(f"pulled {entry.nbytes} bytes for {b.key!r}, "
                                    f"expected {(b.stop - b.start) * DTYPE.itemsize}")
            for offset, piece in entry.pieces:
                start = b.start + offset // DTYPE.itemsize
                arr = np.frombuffer(piece, dtype=DTYPE)
                dest[start:start + arr.size] = arr

    def _downlink_codec(self):
        if self._down_codec is None:
            from hybridfleet.codec import get_codec

            self._down_codec = get_codec(self.codec_name)
        return self._down_codec
