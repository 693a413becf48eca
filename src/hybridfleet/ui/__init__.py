"""Read-only web UI over runs and the model registry (`hfleet ui`)."""
