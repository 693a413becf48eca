"""Re-cut a job's shards: the snapshots of S shards at one version become those of N shards.

The block keys of a `ShardingPlan` depend only on the parameters and the block size, not on
the shard count, so changing the count moves whole blocks: every tensor a snapshot holds
for a block (``param/<key>``, ``broadcast/<key>`` of a compressed downlink, the job
optimizer's ``opt/<key>/<slot>`` and the script optimizer's ``script/<key>/<slot>``, step
counts included) goes, unchanged, to the block's shard under
``ShardingPlan.build(params, N, block_size)``. Each new shard starts at the common version
with each worker's clock (the highest any old shard recorded: no applied push can be
replayed), so a BSP round continues on the new shards exactly as it would have on the old.

Only a round boundary can be handed over: every old snapshot must be at the same version
(BSP or local-SGD rounds; in ASP and SSP shards advance independently and have no common
version). Refusals raise `HandoverError` before anything is written.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.errors import CheckpointError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.server.snapshot import snapshot_url
from hybridfleet.ps.wire.sharding import ShardingPlan
from hybridfleet.spec.rules import ROUND_SYNC_MODES

log = get_logger("ps.handover")

Snapshot = tuple[int, dict[str, np.ndarray], dict]  # (version, tensors, meta), as `snapshot.capture` gives it

# tensor name prefixes whose next path part is a block key
_KEYED = ("param/", "broadcast/", "opt/", "script/")


class HandoverError(CheckpointError):
    """The snapshots cannot be re-cut as asked (nothing was written)."""


def _block_key(name: str) -> tuple[str, str]:
    """(prefix, block key) of a snapshot tensor name."""
    for prefix in _KEYED:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            key = rest if prefix in ("param/", "broadcast/") else rest.rsplit("/", 1)[0]
            return prefix, key
    raise HandoverError(f"snapshot tensor {name!r} belongs to no block (expected one of {', '.join(_KEYED)})")


def recut(snapshots: list[Snapshot], num_shards: int) -> list[Snapshot]:
    """The snapshots of ``num_shards`` shards holding exactly what ``snapshots`` (one per old shard,
    in shard order, all at one version) hold, placed by the re-cut plan.

    Promises: every block's tensors move unchanged to one new shard; versions, each key's version
    and initialisation carry over; the new plan is ``ShardingPlan.build`` of the old plan's
    parameters and block size. Raises HandoverError for ``num_shards`` < 1, an old shard missing or
    twice, snapshots of different versions, plans, codecs or sync modes, or a sync mode without
    rounds."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise HandoverError(f"--shards: must be an integer >= 1 (got {num_shards!r}); nothing changed")
    if not snapshots:
        raise HandoverError("no shard snapshot to hand over; nothing changed")
    metas = [meta for _, _, meta in snapshots]
    first = metas[0]
    if first.get("sync") not in ROUND_SYNC_MODES:
        raise HandoverError(f"shards of sync mode {first.get('sync')!r} cannot be re-cut: only "
                            f"{' and '.join(sorted(ROUND_SYNC_MODES))} shards share a round boundary; nothing changed")
    if first.get("plan") is None:
        raise HandoverError("shard 0's snapshot has no sharding plan (no worker had joined); nothing changed")
    old = ShardingPlan.from_json(first["plan"])
    if [m["shard"] for m in metas] != list(range(old.num_shards)):
        raise HandoverError(f"the plan has {old.num_shards} shard(s); the snapshots given are of shard(s) "
                            f"{[m['shard'] for m in metas]}; nothing changed")
    versions = {int(v) for v, _, _ in snapshots}
    if len(versions) != 1:
        shown = ", ".join(f"shard {m['shard']} at {v}" for (v, _, _), m in zip(snapshots, metas))
        raise HandoverError(f"the shards' snapshots are of different versions ({shown}): hand over at a round "
                            f"boundary, where every shard holds the same version; nothing changed")
    for m in metas[1:]:
        for field in ("plan", "codec", "sync"):
            if m.get(field) != first.get(field):
                raise HandoverError(f"shard {m['shard']}'s snapshot differs from shard 0's in its {field}; "
                                    f"were they taken of one job? nothing changed")
    version = versions.pop()
    new = ShardingPlan.build(list(old.params.values()), num_shards, old.block_size_bytes)
    owner = {b.key: b.shard for b in new.blocks}
    tensors: list[dict[str, np.ndarray]] = [{} for _ in range(num_shards)]
    for _, old_tensors, meta in snapshots:
        mine = {b.key for b in old.blocks_for_shard(meta["shard"])}
        for name, value in old_tensors.items():
            _, key = _block_key(name)
            if key not in mine:
                raise HandoverError(f"shard {meta['shard']}'s snapshot holds {name!r}, a block of another shard; "
                                    f"nothing changed")
            tensors[owner[key]][name] = value
    clocks: dict[str, dict] = {}
    for meta in metas:
        for worker, member in meta["members"].items():
            known = clocks.setdefault(worker, {"site": member["site"], "clock": int(member["clock"])})
            known["clock"] = max(known["clock"], int(member["clock"]))
    key_version = {k: int(v) for m in metas for k, v in m["key_version"].items()}
    initialized = {k for m in metas for k in m["initialized"]}
    applied = max(int(m["applied_pushes"]) for m in metas)
    out = []
    for shard in range(num_shards):
        keys = {b.key for b in new.blocks_for_shard(shard)}
        meta = {"shard": shard, "version": version, "sync": first["sync"], "codec": first["codec"],
                "plan": new.to_json(), "key_version": {k: v for k, v in key_version.items() if k in keys},
                "initialized": sorted(initialized & keys), "applied_pushes": applied,
                "members": {w: dict(m) for w, m in clocks.items()}, "handed_over_from": old.num_shards}
        out.append((version, tensors[shard], meta))
    return out


def reshard_store(store: str, num_shards: int) -> dict:
    """Re-cut the newest snapshots under ``store`` (``<store>/ps/shard-<i>``) for ``num_shards`` shards
    and write them there, at the same version; returns ``{"version", "from_shards", "to_shards",
    "moved_blocks"}``. The shards must be stopped (or held at the round); start ``num_shards`` of
    them for a job with ``ps.shards: num_shards`` and each restores its part. Raises HandoverError
    (nothing written) as `recut` does, or when a shard has no valid snapshot."""
    from hybridfleet.ckpt import load_tensors_checkpoint, save_tensors_checkpoint

    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise HandoverError(f"--shards: must be an integer >= 1 (got {num_shards!r}); nothing changed")
    try:
        first = load_tensors_checkpoint(snapshot_url(store, 0))
    except (CheckpointError, FileNotFoundError) as err:
        raise HandoverError(f"no valid snapshot of shard 0 under {store}: {str(err).splitlines()[0]}; "
                            f"nothing changed") from None
    if first[2].get("plan") is None:
        raise HandoverError("shard 0's snapshot has no sharding plan (no worker had joined); nothing changed")
    old = ShardingPlan.from_json(first[2]["plan"])
    snapshots = [first]
    for shard in range(1, old.num_shards):
        try:
            snapshots.append(load_tensors_checkpoint(snapshot_url(store, shard)))
        except (CheckpointError, FileNotFoundError) as err:
            raise HandoverError(f"no valid snapshot of shard {shard} under {store}: {str(err).splitlines()[0]}; "
                                f"nothing changed") from None
    new = recut(snapshots, num_shards)
    old_owner = {b.key: b.shard for b in old.blocks}
    new_plan = ShardingPlan.from_json(new[0][2]["plan"])
    moved = sum(1 for b in new_plan.blocks if old_owner[b.key] != b.shard)
    for version, tensors, meta in new:
        save_tensors_checkpoint(snapshot_url(store, meta["shard"]), version, tensors, meta)
    log.info("shards_recut", store=store, version=new[0][0], from_shards=old.num_shards, to_shards=num_shards,
             moved_blocks=moved)
    return {"version": new[0][0], "from_shards": old.num_shards, "to_shards": num_shards, "moved_blocks": moved}
