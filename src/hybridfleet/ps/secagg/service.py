"""The SecureAggregation gRPC service of a shard: each request bound to the caller's identity.

Runs on the shard's authenticated gRPC server next to ParameterServer: the token's
worker (``wid``) must be the request's ``worker_id`` (`bind_worker`), each caller holds
its share of the shard's threads (`CallGate`), and message sizes are capped by gRPC's
message limit and checked against the roster before anything is kept.
"""

from __future__ import annotations

import grpc

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.server.identity import bind_worker, grpc_peer_site
from hybridfleet.ps.wire._proto import secagg_pb2 as pb
from hybridfleet.ps.wire.protocol import SECAGG_SERVICE
from hybridfleet.ps.wire.reject import Reject
from hybridfleet.security.grpc_auth import current_claims

log = get_logger("ps.secagg")


class SecAggServicer:
    """Moves SecureAggregation messages between the wire and the shard's `SecAggServer`."""

    def __init__(self, state, gate) -> None:
        self.state = state
        self.gate = gate

    def _run(self, context, request, what: str, fn):
        try:
            identity = bind_worker(request.worker_id, current_claims(), grpc_peer_site(context))
            with self.gate.enter(identity, what):
                with self.state.cond:
                    return fn(self.state.secagg)
        except Reject as rej:
            log.warning("secagg_refused", shard=self.state.shard, call=what, code=rej.code, reason=rej.message)
            context.abort(getattr(grpc.StatusCode, rej.code), rej.message)

    def Advertise(self, request, context):
        epoch = self._run(context, request, "advertise",
                          lambda s: s.advertise(request.worker_id, bytes(request.public_key)))
        return pb.AdvertiseResponse(epoch=epoch)

    def Roster(self, request, context):
        epoch, threshold, roster = self._run(context, request, "roster", lambda s: s.roster_wait(
            request.worker_id, request.known_epoch, request.timeout_s or 60.0))
        return pb.RosterResponse(epoch=epoch, threshold=threshold,
                                 entries=[pb.RosterEntry(worker_id=w, public_key=k) for w, k in roster.items()])

    def Shares(self, request, context):
        self._run(context, request, "shares", lambda s: s.shares(
            request.worker_id, request.round, request.epoch, [(c.peer, bytes(c.data)) for c in request.shares]))
        return pb.SharesResponse()

    def Unmask(self, request, context):
        survivors, dropped, addressed = self._run(context, request, "unmask", lambda s: s.unmask_request(
            request.worker_id, request.round, request.timeout_s or 60.0))
        return pb.UnmaskResponse(survivors=survivors, dropped=dropped,
                                 shares=[pb.Ciphertext(peer=p, data=d) for p, d in addressed])

    def Reveal(self, request, context):
        def reveal(s):
            shares = {sh.owner: bytes(sh.value) for sh in request.shares}
            seeds = {ps.peer: bytes(ps.seed) for ps in request.pair_seeds}
            if len(shares) != len(request.shares) or len(seeds) != len(request.pair_seeds):
                raise Reject("INVALID_ARGUMENT", "the answer names a pusher twice")
            s.reveal(request.worker_id, request.round, shares, seeds)

        self._run(context, request, "reveal", reveal)
        return pb.RevealResponse()


def secagg_handler(servicer: SecAggServicer) -> grpc.GenericRpcHandler:
    """The SecureAggregation service's handlers (protobuf messages)."""
    unary = grpc.unary_unary_rpc_method_handler
    msgs = {"Advertise": (pb.AdvertiseRequest, pb.AdvertiseResponse), "Roster": (pb.RosterRequest, pb.RosterResponse),
            "Shares": (pb.SharesRequest, pb.SharesResponse), "Unmask": (pb.UnmaskRequest, pb.UnmaskResponse),
            "Reveal": (pb.RevealRequest, pb.RevealResponse)}
    return grpc.method_handlers_generic_handler(SECAGG_SERVICE, {
        name: unary(getattr(servicer, name), req.FromString, resp.SerializeToString)
        for name, (req, resp) in msgs.items()})
