"""Script helpers: rank info from either launcher, the shared data partition, rank-0 checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.launch import helpers

_DIST_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM",
              "PADDLE_LOCAL_RANK", "HFLEET_FRAMEWORK", "HFLEET_CKPT_DIR"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _DIST_VARS:
        monkeypatch.delenv(name, raising=False)


def test_dist_info_reads_torch_launcher_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert helpers.dist_info("torch") == (3, 4, 1)


def test_dist_info_reads_paddle_launcher_variables(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_LOCAL_RANK", "1")
    assert helpers.dist_info("paddle") == (1, 2, 1)
    assert helpers.dist_info() == (1, 2, 1)  # found without naming the framework


def test_dist_info_outside_a_launcher_is_a_single_process():
    assert helpers.dist_info() == (0, 1, 0)
    assert helpers.is_rank0()


def test_unknown_framework_is_rejected():
    with pytest.raises(ValueError, match="framework must be one of"):
        helpers.dist_info("jax")


@pytest.mark.parametrize(("n", "world"), [(10, 3), (12, 4), (7, 1), (2, 5)])
def test_shards_are_equal_sized_and_cover_every_index(n, world):
    # Execute
    shards = [helpers.shard_indices(n, rank, world, seed=1, epoch=2) for rank in range(world)]

    # Assert
    assert len({len(s) for s in shards}) == 1
    assert set(np.concatenate(shards).tolist()) == set(range(n))
    if n % world == 0:
        assert len(np.concatenate(shards)) == n  # disjoint when n divides evenly


def test_shards_are_deterministic_per_epoch_and_change_between_epochs():
    first = helpers.shard_indices(100, 0, 2, seed=7, epoch=0)
    assert np.array_equal(first, helpers.shard_indices(100, 0, 2, seed=7, epoch=0))
    assert not np.array_equal(first, helpers.shard_indices(100, 0, 2, seed=7, epoch=1))


def test_unshuffled_shards_match_torch_distributed_sampler():
    from torch.utils.data import DistributedSampler

    for rank in range(3):
        sampler = DistributedSampler(range(10), num_replicas=3, rank=rank, shuffle=False)
        assert helpers.shard_indices(10, rank, 3, shuffle=False).tolist() == list(sampler)


@pytest.mark.parametrize(("args", "message"), [((0, 0, 1), "n must be >= 1"), ((5, 2, 2), "rank must be in 0..world-1")])
def test_bad_shard_arguments_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        helpers.shard_indices(*args)


def test_checkpoint_round_trips_and_latest_is_the_highest_step(monkeypatch, tmp_path):
    # Prepare
    monkeypatch.setenv("HFLEET_CKPT_DIR", str(tmp_path))
    rng = np.random.default_rng(0)
    states = {step: {"w": rng.normal(size=(3, 2)).astype(np.float32)} for step in (2, 10)}

    # Execute
    for step, state in states.items():
        helpers.save_rank0(state, step)
    found = helpers.latest_checkpoint()

    # Assert
    assert found.step == 10
    assert np.array_equal(found.state["w"], states[10]["w"])
    assert not list(tmp_path.glob("*.tmp"))


def test_tensors_without_their_manifest_are_not_a_checkpoint(monkeypatch, tmp_path):
    # Prepare: step 4 complete, step 6 cut off before its manifest was written
    monkeypatch.setenv("HFLEET_CKPT_DIR", str(tmp_path))
    helpers.save_rank0({"w": np.ones(2, np.float32)}, 4)
    newest = helpers.save_rank0({"w": np.zeros(2, np.float32)}, 6)
    (newest / "MANIFEST.json").unlink()

    # Execute / Assert
    assert helpers.latest_checkpoint().step == 4


def test_only_rank0_writes_checkpoints(monkeypatch, tmp_path):
    monkeypatch.setenv("HFLEET_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert helpers.save_rank0({"w": np.ones(2)}, 1) is None
    assert list(tmp_path.iterdir()) == []


def test_without_ckpt_dir_nothing_is_saved_or_found():
    assert helpers.save_rank0({"w": np.ones(2)}, 1) is None
    assert helpers.latest_checkpoint() is None


def test_non_numpy_state_is_rejected_and_nothing_written(monkeypatch, tmp_path):
    monkeypatch.setenv("HFLEET_CKPT_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"state_dict_numpy\['w'\] must be a numpy array \(got list\)"):
        helpers.save_rank0({"w": [1, 2]}, 1)
    assert list(tmp_path.iterdir()) == []


def test_log_rank0_prints_one_json_line_on_rank0_only(monkeypatch, capsys):
    helpers.log_rank0("epoch", epoch=3)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    helpers.log_rank0("epoch", epoch=4)
    assert capsys.readouterr().out == '{"event": "epoch", "epoch": 3}\n'


@pytest.mark.parametrize(("framework", "to"), [("torch", "paddle"), ("paddle", "torch")])
def test_model_saved_by_the_helpers_resumes_and_converts_to_the_other_framework(monkeypatch, tmp_path, framework, to):
    # Prepare: what the README's `hfleet launch` examples do every epoch
    from hybridfleet.ckpt import load_checkpoint
    from hybridfleet.cli.app import main as cli_main
    from tests.test_frameworks import make_model

    monkeypatch.setenv("HFLEET_CKPT_DIR", str(tmp_path / "ckpt"))
    model = make_model(framework, seed=3)
    helpers.save_rank0(model, 6)
    # Execute
    found = helpers.latest_checkpoint()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "converted"), "--to", to])
        raise SystemExit(0)
    # Assert: resume sees the model's own state dict; convert writes a checkpoint the other framework loads
    assert exit_info.value.code == 0
    own = {k: np.asarray(v.detach().numpy() if framework == "torch" else v.numpy()) for k, v in model.state_dict().items()}
    assert found.step == 6 and sorted(found.state) == sorted(own)
    np.testing.assert_array_equal(found.state["0.weight"], own["0.weight"])
    other = make_model(to, seed=99)
    info = load_checkpoint(str(tmp_path / "converted"), model=other)
    weight = other.state_dict()["0.weight"]
    assert info.step == 6
    np.testing.assert_array_equal(np.asarray(weight.detach().numpy() if to == "torch" else weight.numpy()).T, own["0.weight"])


def test_finish_flushes_output_and_exits_with_the_code_without_teardown(tmp_path):
    import subprocess
    import sys

    # an atexit handler stands for the interpreter teardown that finish() must skip
    code = ("import atexit, sys\nfrom hybridfleet.launch.helpers import finish\n"
            "atexit.register(lambda: print('teardown ran'))\nprint('final line', end='')\nfinish(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "final line"
