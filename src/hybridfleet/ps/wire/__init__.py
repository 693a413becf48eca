"""What shards and workers agree on: protocol constants, protobuf messages, bulk framing, the sharding plan."""
