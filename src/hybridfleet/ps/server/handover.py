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


def stored_shard_count(store: str) -> int | None:
    """How many shards the newest snapshot of shard 0 under ``store`` was cut for (None: no snapshot
    with a plan there)."""
    from hybridfleet.ckpt import load_tensors_checkpoint

    try:
        _, _, meta = load_tensors_checkpoint(snapshot_url(store, 0))
    except (CheckpointError, FileNotFoundError):
        return None
    return ShardingPlan.from_json(meta["plan"]).num_shards if meta.get("plan") else None


def reshard_store(store: str, num_shards: int) -> dict:
    """Re-cut the snapshots under ``store`` (``<store>/ps/shard-<i>``) for ``num_shards`` shards, from
    the newest version every old shard has a valid snapshot of, and write them there at that
    version; returns ``{"version", "from_shards", "to_shards", "moved_blocks"}``. The shards must be
    stopped; start ``num_shards`` of them for a job with ``ps.shards: num_shards`` and each restores
    its part. A new shard's own snapshots newer than that version (which the other shards lack) are
    retired (``retired_newer``). Raises HandoverError (nothing written) as `recut` does, or when no
    version is held by every shard."""
    from hybridfleet.ckpt import list_checkpoints, load_tensors_checkpoint, save_tensors_checkpoint

    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise HandoverError(f"--shards: must be an integer >= 1 (got {num_shards!r}); nothing changed")
    old_count = stored_shard_count(store)
    if old_count is None:
        raise HandoverError(f"no valid snapshot of shard 0 (with a sharding plan) under {store}; nothing changed")
    steps = []
    for shard in range(old_count):
        held = {c.step for c in list_checkpoints(snapshot_url(store, shard))}
        if not held:
            raise HandoverError(f"no valid snapshot of shard {shard} under {store} (the plan has {old_count} "
                                f"shards); nothing changed")
        steps.append(held)
    common = set.intersection(*steps)
    if not common:
        raise HandoverError(f"no version has a snapshot on every one of the {old_count} shards under {store} "
                            f"(newest of each: {[max(s) for s in steps]}); nothing changed")
    version = max(common)
    snapshots = [load_tensors_checkpoint(snapshot_url(store, shard), step=version) for shard in range(old_count)]
    new = recut(snapshots, num_shards)
    old = ShardingPlan.from_json(snapshots[0][2]["plan"])
    old_owner = {b.key: b.shard for b in old.blocks}
    new_plan = ShardingPlan.from_json(new[0][2]["plan"])
    moved = sum(1 for b in new_plan.blocks if old_owner[b.key] != b.shard)
    retired = {}
    for _, tensors, meta in new:
        url = snapshot_url(store, meta["shard"])
        save_tensors_checkpoint(url, version, tensors, meta)
        retired[meta["shard"]] = _retire_newer(url, version)
    log.info("shards_recut", store=store, version=version, from_shards=old_count, to_shards=num_shards,
             moved_blocks=moved, retired_newer={s: v for s, v in retired.items() if v})
    return {"version": version, "from_shards": old_count, "to_shards": num_shards, "moved_blocks": moved,
            "retired_newer": {s: v for s, v in retired.items() if v}}


def _retire_newer(url: str, version: int) -> list[int]:
    """Make a shard's snapshots newer than ``version`` invisible (their manifest removed, the rest left to
    `hybridfleet.ckpt.gc`): no other shard holds those versions, so the re-cut one must be restored."""
    from hybridfleet.ckpt import list_checkpoints
    from hybridfleet.ckpt.manifest import MANIFEST_NAME, step_dir
    from hybridfleet.store import open_store

    newer = [c.step for c in list_checkpoints(url) if c.step > version]
    store = open_store(url)
    for step in newer:
        store.rm(f"{step_dir(step)}/{MANIFEST_NAME}")
    return newer
