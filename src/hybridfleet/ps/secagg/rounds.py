"""A pushing worker's secure rounds against every shard: setup, masked push, unmask answers.

Used by `PSSession` in place of codec encoding when ``ps.secure_aggregation`` is on:
per shard, the worker's update for the shard's keys (after DP noise, after the
``norm_clip`` bound on the pusher, random-k coordinates shared by every pusher) is
masked (`ShardMasker`), its seed's encrypted shares go to the shard (Shares), the ring
vector goes through the ordinary Push, and the worker answers the shard's unmask
request (Unmask, Reveal) before it pulls the round's result.
"""

from __future__ import annotations

import math
import time

import grpc
import numpy as np

from hybridfleet.errors import SECURE_ROUND_HINT, ProtocolError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.secagg.pusher import ShardMasker
from hybridfleet.ps.secagg.server import kept_indices
from hybridfleet.ps.secagg.settings import SecAggSettings
from hybridfleet.ps.wire._proto import secagg_pb2 as pb
from hybridfleet.ps.wire._proto import secagg_pb2_grpc

log = get_logger("ps.secagg")

WAIT_S = 120.0        # one long-poll
ROUND_WAIT_S = 600.0  # how long a round's unmask may wait for the other pushers


class SecureRounds:
    """Drives secure aggregation for one `PSClient` (joined) over all its shards."""

    def __init__(self, client, settings: SecAggSettings, ps) -> None:
        self.client = client
        self.settings = settings
        self._stubs: dict[int, tuple[object, secagg_pb2_grpc.SecureAggregationStub]] = {}  # shard -> (channel, stub)
        self.maskers = {i: ShardMasker(client.worker_id, i, settings) for i in range(len(client.servers))}
        self.norm_clip = ps.aggregate.clip_norm if ps.aggregate.rule == "norm_clip" else None
        self.error_feedback = ps.compression.error_feedback
        self.residual: dict[str, np.ndarray] = {}
        self._staged: dict[str, np.ndarray] = {}  # this push's residuals until it is settled
        self.bytes_key_material = 0  # public keys, shares and unmask answers sent
        # shard -> (round, epoch, masked vector, its Shares request), made before the shares go out
        self._sent: dict[int, tuple[int, int, np.ndarray, pb.SharesRequest]] = {}
        self._answers: dict[int, tuple[int, pb.RevealRequest]] = {}  # shard -> (round, its answer) last given

    # ----------------------------------------------------------------- rpc
    def _stub(self, shard: int) -> secagg_pb2_grpc.SecureAggregationStub:
        """The stub on the client's channel to ``shard`` now: a shard replaced at a new address is
        reached on a new channel (`PSClient._follow`), and the old one is closed."""
        channel = self.client._channels[shard]
        kept = self._stubs.get(shard)
        if kept is None or kept[0] is not channel:
            kept = self._stubs[shard] = (channel, secagg_pb2_grpc.SecureAggregationStub(channel))
        return kept[1]

    def _rpc(self, shard: int, method: str, request, timeout: float):
        self.client.bytes.add_sent("secagg", request)
        self.bytes_key_material += request.ByteSize()
        try:
            return self.client._call(shard, lambda _: getattr(self._stub(shard), method)(
                request, metadata=self.client._metadata, timeout=timeout + 30), what=f"secure aggregation {method}")
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.ABORTED:
                raise ProtocolError(err.details(), hint=SECURE_ROUND_HINT) from None
            raise

    def _setup(self, shard: int) -> None:
        """Advertise this worker's key (a fresh one after an eviction) and wait for a roster holding it."""
        m = self.maskers[shard]
        if m.in_roster:
            m.fresh_key()
        try:
            self._rpc(shard, "Advertise", pb.AdvertiseRequest(worker_id=self.client.worker_id,
                                                              public_key=m.keypair.public), 30)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:  # ours, still pending: wait for the roster
                raise
        known, deadline = -1, time.monotonic() + ROUND_WAIT_S
        while True:
            r = self._rpc(shard, "Roster", pb.RosterRequest(worker_id=self.client.worker_id, known_epoch=known,
                                                            timeout_s=WAIT_S), WAIT_S)
            if m.set_roster(r.epoch, r.threshold, {e.worker_id: bytes(e.public_key) for e in r.entries}):
                log.info("secagg_roster_joined", shard=shard, epoch=r.epoch, pushers=len(r.entries))
                return
            if time.monotonic() > deadline:
                raise ProtocolError(f"shard {shard} published no roster with this worker's key within "
                                    f"{ROUND_WAIT_S:.0f} s")
            known = r.epoch

    def _current_epoch(self, shard: int) -> tuple[int, bytes | None]:
        """The shard's roster epoch and this worker's key in it; (0, None) when it has none (e.g. it restarted)."""
        try:
            r = self._rpc(shard, "Roster", pb.RosterRequest(worker_id=self.client.worker_id, known_epoch=-1,
                                                            timeout_s=0.1), 5)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return 0, None
        return r.epoch, next((bytes(e.public_key) for e in r.entries if e.worker_id == self.client.worker_id), None)

    # ---------------------------------------------------------------- push
    def _vector(self, shard: int, rnd: int, grads: dict[str, np.ndarray], contributors: int) -> np.ndarray:
        parts = []
        for b in self.client.plan.blocks_for_shard(shard):
            g = grads[b.key]
            if self.settings.randomk_ratio is not None:
                acc = g + self.residual[b.key] if b.key in self.residual else g.copy()
                idx = kept_indices(b.key, rnd, g.size, self.settings.randomk_ratio)
                kept = acc[idx]
                if self.error_feedback:
                    acc[idx] = 0
                    self._staged[b.key] = acc
                g = kept
            parts.append(np.asarray(g, dtype=np.float32))
        vector = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        if self.norm_clip is not None:  # the rule's bound, on the pusher: the mean update's norm on this shard
            norm = float(np.linalg.norm(vector / contributors))
            if norm > self.norm_clip:
                vector *= np.float32(self.norm_clip / norm)
        return vector

    def commit(self) -> None:
        """Keep the random-k residuals of the push just applied."""
        self.residual.update(self._staged)
        self._staged.clear()

    def discard(self) -> None:
        """Forget the random-k residuals of a push that was not applied: each key keeps the one it had."""
        self._staged.clear()

    def _mask_one(self, shard: int, rnd: int, grads: dict[str, np.ndarray], contributors: int,
                  present: set[str] | None = None) -> dict[str, bytes]:
        """The shard's keys' masked payloads; ``present``: the parameters this pusher had a gradient for
        (None: all of them)."""
        blocks = self.client.plan.blocks_for_shard(shard)
        if not blocks:
            return {}
        m = self.maskers[shard]
        sent = self._sent.get(shard)
        if sent is not None and sent[:2] == (rnd, m.epoch) and m.in_roster:
            # this round was masked already (a retried push): the same masked vector again, since a fresh
            # one would carry a self mask whose shares the shard does not hold; the same shares go again,
            # in case the connection was lost before they arrived (the shard keeps the first copy; a round
            # being unmasked takes none, and the push then says whether this worker's is in it)
            self._send_shares(shard, sent[3], again=True)
            return self._payloads(blocks, sent[2])
        vector = self._vector(shard, rnd, grads, contributors)
        for _ in range(3):
            if not m.in_roster or not m.epoch:
                self._setup(shard)
            ring, shares = m.mask(rnd, vector, np.array([present is None or b.param in present for b in blocks]))
            request = pb.SharesRequest(worker_id=self.client.worker_id, round=rnd, epoch=m.epoch,
                                       shares=[pb.Ciphertext(peer=q, data=d) for q, d in shares])
            self._sent[shard] = (rnd, m.epoch, ring, request)  # before sending: the shard may get them unanswered
            try:
                self._send_shares(shard, request)
                break
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                epoch, key = self._current_epoch(shard)
                if epoch == m.epoch and key == m.keypair.public:
                    raise  # not the roster: a stale round, handled like a stale push
                if key != m.keypair.public:
                    self._setup(shard)  # evicted (or never admitted): fresh key
                else:
                    m.in_roster, m.epoch = True, 0  # the roster grew: fetch it
                    self._setup_roster_only(shard)
        else:
            raise ProtocolError(f"shard {shard}'s roster kept changing; no masked push sent")
        return self._payloads(blocks, ring)

    def _send_shares(self, shard: int, request: pb.SharesRequest, again: bool = False) -> None:
        """Send a round's encrypted shares; ``again``: the same request once more, which the shard may
        hold already (ALREADY_EXISTS: it keeps the first) or refuse because the round is being unmasked
        or moved on (FAILED_PRECONDITION: the push that follows is refused likewise, or answers that
        this worker's push is in the round)."""
        try:
            self._rpc(shard, "Shares", request, 30)
        except grpc.RpcError as err:
            if not (again and err.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION)):
                raise

    def _payloads(self, blocks, ring: np.ndarray) -> dict[str, bytes]:
        """Per key: its kept ring elements, then its presence element (the ring's tail, one per key)."""
        out, offset, flags = {}, 0, ring.size - len(blocks)
        for i, b in enumerate(blocks):
            n = b.stop - b.start
            if self.settings.randomk_ratio is not None:
                n = min(n, max(1, math.ceil(self.settings.randomk_ratio * n)))
            out[b.key] = ring[offset:offset + n].tobytes() + ring[flags + i:flags + i + 1].tobytes()
            offset += n
        return out

    def _setup_roster_only(self, shard: int) -> None:
        m = self.maskers[shard]
        r = self._rpc(shard, "Roster", pb.RosterRequest(worker_id=self.client.worker_id, known_epoch=-1,
                                                        timeout_s=5), 5)
        if not m.set_roster(r.epoch, r.threshold, {e.worker_id: bytes(e.public_key) for e in r.entries}):
            self._setup(shard)

    def push(self, grads: dict[str, np.ndarray], base_versions: list[int], contributors: int,
             optimizer_json: str = "", present: set[str] | None = None):
        """Mask and push this step's update (key -> float32 block, zeros for a parameter without a
        gradient) to every shard; ``present``: the parameters with a gradient (None: all). A key no
        pusher of the round had a gradient for is not stepped. Raises like `PSClient.push`."""
        payload_parts = self.client._each_shard(
            lambda i: self._mask_one(i, base_versions[i], grads, contributors, present))
        payloads = {k: v for part in payload_parts for k, v in part.items()}
        return self.client.push(payloads, codec=self.settings.codec_name, base_versions=base_versions,
                                contributors=contributors, optimizer_json=optimizer_json)

    def finish(self, grads: dict[str, np.ndarray], base_versions: list[int], contributors: int,
               optimizer_json: str, present: set[str] | None, shards: list[int]) -> None:
        """Finish a step a lost connection (or a shard's restart) interrupted, at ``shards``: each holds
        the step's round open. Where this worker answered the round's unmask, its push is in; elsewhere
        the round is masked again and pushed to that shard alone: the same vector and shares where the
        shard still holds this worker's key (a push that did arrive is kept), made afresh with a new
        key where the shard came back without keys. Each shard's unmask is then answered once (an
        answer sent before goes again unchanged: its connection may have lost it).

        The shards that kept this worker's key are finished first, answers included, and only then
        those that need a new roster: a new roster waits for every worker's key, and a worker still
        busy at a shard that stayed up may be waiting there for this worker's push or answer.
        Raises like `PSClient.push`; a shard whose round closed without this worker refuses with
        FAILED_PRECONDITION."""
        kept, fresh = [], []
        for i in shards:
            m = self.maskers[i]
            epoch, key = self._current_epoch(i)
            if key != m.keypair.public:  # the shard lost this worker's key (it restarted): a fresh one
                self._sent.pop(i, None)
                m.epoch = 0
                fresh.append(i)
                continue
            if not m.answered(base_versions[i]) and epoch != m.epoch:  # the roster moved on: mask for it
                self._sent.pop(i, None)
                self._setup_roster_only(i)
            kept.append(i)
        for group in (kept, fresh):
            for i in group:
                if self.maskers[i].answered(base_versions[i]):  # pushed and answered: the answer may go again
                    continue
                payloads = self._mask_one(i, base_versions[i], grads, contributors, present)
                try:
                    self.client.push(payloads, codec=self.settings.codec_name, base_versions=base_versions,
                                     contributors=contributors, optimizer_json=optimizer_json, only_shard=i)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.ALREADY_EXISTS:  # held already: the push did arrive
                        raise
                log.info("secagg_step_finished", shard=i, round=base_versions[i], fresh_key=i in fresh)
            if group:
                self.unmask(base_versions, group, again=True)

    def unmask(self, base_versions: list[int], only: list[int] | None = None, again: bool = False) -> None:
        """Answer each shard's unmask request for the round just pushed (``only``: those shards).
        A round answered already is not answered twice; ``again`` (a connection was lost): the answer
        given goes once more, unchanged, in case it was lost on the way."""
        shards = {b.shard for b in self.client.plan.blocks}
        if only is not None:
            shards &= set(only)

        def one(i: int) -> None:
            if i not in shards:
                return
            rnd, deadline = base_versions[i], time.monotonic() + ROUND_WAIT_S
            if self.maskers[i].answered(rnd):
                # a step retried after another shard refused it, or a connection lost: never a second answer
                if again:
                    self._answer_again(i, rnd)
                return
            req = pb.UnmaskRequest(worker_id=self.client.worker_id, round=rnd, timeout_s=WAIT_S)
            while True:
                try:
                    r = self._rpc(i, "Unmask", req, WAIT_S)
                    break
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                        raise
            shares, seeds = self.maskers[i].answer(rnd, list(r.survivors), list(r.dropped),
                                                   {c.peer: bytes(c.data) for c in r.shares})
            answer = pb.RevealRequest(worker_id=self.client.worker_id, round=rnd,
                                      shares=[pb.Share(owner=p, value=v) for p, v in shares.items()],
                                      pair_seeds=[pb.PairSeed(peer=d, seed=s) for d, s in seeds.items()])
            self._answers[i] = (rnd, answer)
            self._rpc(i, "Reveal", answer, 30)

        self.client._each_shard(one)

    def _answer_again(self, shard: int, rnd: int) -> None:
        """Send round ``rnd``'s answer to ``shard`` again, unchanged; a shard that has it (ALREADY_EXISTS)
        or has closed the round meanwhile (FAILED_PRECONDITION) needs nothing more."""
        kept = self._answers.get(shard)
        if kept is None or kept[0] != rnd:
            return
        try:
            self._rpc(shard, "Reveal", kept[1], 30)
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION):
                raise
