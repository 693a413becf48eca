"""Generated from proto/hybridfleet/ps/v1/*.proto by hybridfleet.ps.wire.proto_gen; do not edit."""
