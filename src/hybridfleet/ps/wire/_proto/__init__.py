"""Generated from proto/hybridfleet/ps/v1/ps.proto by hybridfleet.ps.wire.proto_gen; do not edit."""
