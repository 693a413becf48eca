"""Resume a parameter-server job with another shard count: re-cut its snapshots before the shards start."""

from __future__ import annotations

from hybridfleet.errors import LaunchError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.server.handover import HandoverError, reshard_store, stored_shard_count
from hybridfleet.spec.models import JobSpec

log = get_logger("launch.reshard")


def reshard_for_resume(spec: JobSpec, store: str) -> dict | None:
    """When the snapshots under ``store`` were cut for another count than ``spec.ps.shards``, re-cut
    them (see `hybridfleet.ps.server.handover.reshard_store`) and return what moved; None when they
    already fit or there are none. LaunchError (nothing changed) when they cannot be re-cut."""
    stored = stored_shard_count(store)
    if stored is None or stored == spec.ps.shards:
        return None
    try:
        moved = reshard_store(store, spec.ps.shards)
    except HandoverError as err:
        raise LaunchError(f"--resume: the snapshots of {stored} shard(s) cannot be re-cut for ps.shards: "
                          f"{spec.ps.shards}: {err}",
                          hint=f"resume with ps.shards: {stored}, or from a run whose shards share a snapshot "
                               "version") from None
    log.info("resumed_with_new_shard_count", **moved)
    return moved
