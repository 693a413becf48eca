"""Re-cutting shards at a round boundary: 2 -> 4 -> 3 shards end bit-identical to 2 shards throughout.

Shard states are driven in-process (the logic under the network layer, as the shard's
unit tests do); each new shard restores its part the way `start_shard` does and every
worker joins it with the new shard count, so the re-cut plan is checked against the
plan a worker builds.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.ckpt import list_checkpoints
from hybridfleet.codec import get_codec
from hybridfleet.ps.server.handover import HandoverError, recut, reshard_store
from hybridfleet.ps.server.shard import ShardState
from hybridfleet.ps.server.snapshot import Snapshotter, capture, restore, snapshot_url
from hybridfleet.ps.wire.sharding import ParamSpec
from tests.ps_helpers import job_spec

PARAMS = [ParamSpec("emb", (400, 8)), ParamSpec("w", (32, 32)), ParamSpec("b", (8,)), ParamSpec("head", (32, 20))]
BLOCK = 1024  # bytes: emb is cut into 13 blocks, w into 4, head into 3
WORKERS = {"a-0": "a", "b-0": "b"}
NONE = get_codec("none")


def _spec(shards: int, sync: str = "bsp"):
    return job_spec(None, None, shards=shards, sync=sync, block_size_bytes=BLOCK,
                    optimizer={"name": "adam", "lr": 0.05}, heartbeat_timeout_s=60.0).ps


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {p.name: rng.standard_normal(p.numel).astype(np.float32) for p in PARAMS}


def _script_optimizer(framework: str) -> str:
    """The description a worker sends of a script's optimizer over PARAMS (torch AdamW, paddle Momentum)."""
    from hybridfleet.ps.worker.optim_spec import encode, reader_for

    if framework == "torch":
        import torch

        params = {p.name: torch.nn.Parameter(torch.zeros(p.shape)) for p in PARAMS}
        opt = torch.optim.AdamW(list(params.values()), lr=0.01, weight_decay=0.05)
    else:
        import paddle

        params = {p.name: paddle.create_parameter(list(p.shape), "float32") for p in PARAMS}
        opt = paddle.optimizer.Momentum(learning_rate=0.01, momentum=0.9, parameters=list(params.values()))
    return encode(reader_for(opt, framework, params).describe())


class Job:
    """The shards of one job and its two workers' pushes, round after round. ``framework``: the
    shards run that framework's script optimizer (None: the job's ``ps.optimizer``, numpy Adam)."""

    def __init__(self, shards: int, sync: str = "bsp", framework: str | None = None):
        self.flavour = framework or "torch"
        self.optimizer_json = _script_optimizer(framework) if framework else ""
        self.states = self.new_states(shards, sync)
        self.step = 0
        self.join()
        plan = self.states[0].plan
        for state in self.states:
            blocks = {b.key: part for name, v in _initial().items() for b, part in
                      zip(plan.blocks_of(name), plan.split(name, v).values()) if b.shard == state.shard}
            state.push("a-0", "a", "INIT", 0, 0, "none", {k: v.tobytes() for k, v in blocks.items()})

    def new_states(self, shards: int, sync: str = "bsp") -> list[ShardState]:
        return [ShardState(i, _spec(shards, sync), flavour=self.flavour, sites={"a": 1, "b": 1})
                for i in range(shards)]

    def join(self) -> None:
        for state in self.states:
            for worker, site in WORKERS.items():
                state.join(worker, site, PARAMS, len(self.states), BLOCK, "none")

    def params(self) -> dict[str, np.ndarray]:
        plan = self.states[0].plan
        parts = {k: v for s in self.states for k, v in s.snapshot_arrays().items()}
        return {p.name: plan.join(p.name, {b.key: parts[b.key] for b in plan.blocks_of(p.name)}).reshape(-1)
                for p in PARAMS}

    def rounds(self, n: int) -> None:
        """``n`` BSP rounds; each worker's gradient depends on the current parameters and the round."""
        for _ in range(n):
            self.step += 1
            current = self.params()
            plan = self.states[0].plan
            pushes = {}
            for w_index, worker in enumerate(WORKERS):
                payloads = {}
                for name, value in current.items():
                    grad = 0.1 * value + np.sin(np.arange(value.size, dtype=np.float32) + self.step + w_index)
                    for key, part in plan.split(name, grad.astype(np.float32)).items():
                        payloads[key] = NONE.encode(part)
                pushes[worker] = payloads
            for worker, payloads in pushes.items():
                for state in self.states:
                    mine = {k: v for k, v in payloads.items() if k in set(state.keys)}
                    state.push(worker, WORKERS[worker], "GRADIENT", self.step, state.version, "none", mine,
                               optimizer_json=self.optimizer_json)
        assert {s.version for s in self.states} == {self.step}

    def recut_to(self, shards: int) -> None:
        """Hand the states over to ``shards`` new shards (in memory) and have every worker join them."""
        new = recut([capture(s) for s in self.states], shards)
        self.states = self.new_states(shards)
        for state, (_, tensors, meta) in zip(self.states, new):
            restore(state, tensors, meta)
        self.join()


@pytest.mark.parametrize("framework", [None, pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)],
                         ids=["job-adam", "torch-adamw", "paddle-momentum"])
def test_two_to_four_to_three_shards_mid_run_ends_bit_identical_to_two_shards_throughout(tmp_path, framework):
    # Prepare: the uninterrupted run
    reference = Job(2, framework=framework)
    reference.rounds(12)
    want = reference.params()
    # Execute: 2 shards for 4 rounds, 4 for 4 (in memory), 3 for 4 (through the snapshot store)
    job = Job(2, framework=framework)
    job.rounds(4)
    job.recut_to(4)
    job.rounds(4)
    store = f"file://{tmp_path / 'snap'}"
    for state in job.states:
        Snapshotter(state, snapshot_url(store, state.shard), None, None).save()
    moved = reshard_store(store, 3)
    job.states = job.new_states(3)
    for state in job.states:
        assert Snapshotter(state, snapshot_url(store, state.shard), None, None).restore_newest() == 8
    job.join()
    job.rounds(4)
    # Assert: every parameter bit-identical (the optimizer's slots and step counts moved with their blocks)
    assert moved["from_shards"] == 4 and moved["to_shards"] == 3 and moved["moved_blocks"] > 0
    assert job.states[0].plan.num_shards == 3
    got = job.params()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # every worker's clock came along: a replay of an applied step is still refused
    with pytest.raises(Exception, match="replays an applied step"):
        job.states[0].push("a-0", "a", "GRADIENT", 12, job.states[0].version, "none", {})


def test_recut_refuses_bad_counts_mixed_versions_and_asp_and_changes_nothing():
    job = Job(2)
    job.rounds(2)
    snaps = [capture(s) for s in job.states]
    before = [{k: v.copy() for k, v in t.items()} for _, t, _ in snaps]
    with pytest.raises(HandoverError, match=r"--shards: must be an integer >= 1 \(got 0\); nothing changed"):
        recut(snaps, 0)
    skewed = [snaps[0], (snaps[1][0] + 1, snaps[1][1], {**snaps[1][2], "version": snaps[1][0] + 1})]
    with pytest.raises(HandoverError, match="different versions .*shard 0 at 2, shard 1 at 3.*round boundary"):
        recut(skewed, 3)
    with pytest.raises(HandoverError, match=r"snapshots given are of shard\(s\) \[0\]"):
        recut(snaps[:1], 3)
    asp = Job(2, sync="asp")
    with pytest.raises(HandoverError, match="sync mode 'asp' cannot be re-cut"):
        recut([capture(s) for s in asp.states], 3)
    for (_, tensors, _), kept in zip(snaps, before):  # the inputs are untouched
        assert set(tensors) == set(kept)
        for k in kept:
            np.testing.assert_array_equal(tensors[k], kept[k])


def test_reshard_store_with_a_shard_missing_its_snapshot_writes_nothing(tmp_path):
    job = Job(2)
    job.rounds(2)
    store = f"file://{tmp_path / 'snap'}"
    Snapshotter(job.states[0], snapshot_url(store, 0), None, None).save()
    before = [c.step for c in list_checkpoints(snapshot_url(store, 0))]
    with pytest.raises(HandoverError, match="no valid snapshot of shard 1 .*nothing changed"):
        reshard_store(store, 3)
    assert [c.step for c in list_checkpoints(snapshot_url(store, 0))] == before
    assert list_checkpoints(snapshot_url(store, 2)) == []


def test_reshard_store_starts_from_the_newest_version_every_shard_holds_and_retires_newer_ones(tmp_path):
    # Prepare: both shards snapshot version 2; only shard 0 also reached a snapshot of version 4
    reference = Job(2)
    reference.rounds(6)
    job = Job(2)
    job.rounds(2)
    store = f"file://{tmp_path / 'snap'}"
    for state in job.states:
        Snapshotter(state, snapshot_url(store, state.shard), None, None).save()
    job.rounds(2)
    Snapshotter(job.states[0], snapshot_url(store, 0), None, None).save()
    # Execute
    moved = reshard_store(store, 3)
    job.states = [ShardState(i, _spec(3), sites={"a": 1, "b": 1}) for i in range(3)]
    restored = [Snapshotter(s, snapshot_url(store, s.shard), None, None).restore_newest() for s in job.states]
    job.join()
    job.step = 2  # the workers go on from the restored version
    job.rounds(4)
    # Assert
    assert moved["version"] == 2 and moved["retired_newer"] == {0: [4]} and restored == [2, 2, 2]
    want = reference.params()
    for name, value in job.params().items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_cli_ps_reshard_recuts_a_store_and_refuses_a_bad_count_without_changing_it(tmp_path):
    import json
    import subprocess
    import sys

    job = Job(2)
    job.rounds(2)
    folder = tmp_path / "snap"
    for state in job.states:
        Snapshotter(state, snapshot_url(f"file://{folder}", state.shard), None, None).save()
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hybridfleet", "ps", "reshard", *args], capture_output=True,
                              text=True, timeout=120)

    bad = cli(str(folder), "--shards", "0")
    assert bad.returncode == 2 and "--shards: must be an integer >= 1 (got 0); nothing changed" in bad.stderr
    assert not (folder / "ps" / "shard-2").exists()
    assert [c.step for c in list_checkpoints(snapshot_url(f"file://{folder}", 0))] == [2]
    ok = cli(str(folder), "--shards", "3")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1])["to_shards"] == 3
    fresh = ShardState(2, _spec(3), sites={"a": 1, "b": 1})
    assert Snapshotter(fresh, snapshot_url(f"file://{folder}", 2), None, None).restore_newest() == 2
    assert fresh.plan.num_shards == 3 and set(fresh.params) == {b.key for b in fresh.plan.blocks_for_shard(2)}
