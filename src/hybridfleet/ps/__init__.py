"""Parameter server: wire protocol, shard state, gRPC server and client, worker sessions."""
