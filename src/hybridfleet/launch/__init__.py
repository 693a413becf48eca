"""Launching training: collective data parallel (torch / paddle launchers) and local process groups."""
