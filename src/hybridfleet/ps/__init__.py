"""Parameter server, split by role.

- `hybridfleet.ps.server`: a shard — state, validation, consistency, optimizers, snapshots, gRPC and bulk servers.
- `hybridfleet.ps.worker`: a worker — session, client, site aggregation, framework front-end.
- `hybridfleet.ps.wire`: what both sides agree on — protocol constants, protobuf, bulk framing, sharding plan.
- `hybridfleet.ps.aggregate`: how a round's updates are combined (mean, robust rules, secure aggregation).
"""
