"""A parameter-server shard: state, consistency, optimizers, snapshots and the servers that expose it."""
