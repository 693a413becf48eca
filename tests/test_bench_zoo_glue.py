"""bench/zoo.py's glue for fashion and charlm: the collective runner trains each example as its script does.

In one process, no launcher: each workload's glue builds the script's model, optimizer and
schedule from the script's own arguments, loads a tiny packed slice, steps through the
runner's own loop (bench/_zoo_ddp.py `train_loop`, the model unwrapped) and evaluates the
script's metric; the learning rate after k schedule steps is the script's schedule, written
out here in closed form. The slow tests run the real script alone (a subprocess, as
bench/zoo.py's ``alone`` row does) and check the runner's loop reports the same losses and
ends at the same metric, and run the runner under ``hfleet launch`` (2 processes, gloo) with
the script's arguments, as bench/zoo.py's ``ddp`` row does.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.needs import missing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import _zoo_ddp  # noqa: E402
import zoo  # noqa: E402
from _zoo_workloads import WORKLOADS  # noqa: E402

from hybridfleet.data.pack import pack_arrays  # noqa: E402

STEPS = 10
BATCH = 8
TINY_ARGS = {
    "fashion": ["--width", "4", "--test-rows", "64", "--lr", "0.1"],
    "charlm": ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--lr", "0.01",
               "--warmup-steps", "4", "--test-bytes", "2000"],
}
FRAMEWORK_PARAMS = [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)]


def _packed(name: str, dest: Path) -> Path:
    """A tiny packed dataset for ``name``: 64 Fashion-MNIST rows of site A, or a 20 kB slice of charlm's site A."""
    _, data_mod = WORKLOADS[name].modules()
    if name == "fashion":
        if not (data_mod.data_dir() / "train-images-idx3-ubyte.gz").is_file():
            missing(f"Fashion-MNIST is not installed at {data_mod.data_dir()}: apt-get install dataset-fashion-mnist "
                    "(.ci/install-datasets.sh)")
        pixels, labels = data_mod.split_rows("fashion:site-a", 64)
        arrays = {"pixels": pixels, "label": labels}
    else:
        arrays = {"window": data_mod.split_rows("charlm:site-a", max_bytes=20_000, window=33)}
    pack_arrays(arrays, str(dest))
    return dest


def _script_lr(name: str, options, k: int, steps: int) -> float:
    """The script's learning rate after ``k`` schedule steps of a ``steps``-step run, in closed form."""
    if name == "fashion":  # CosineAnnealingLR / CosineAnnealingDecay over the run's steps, down to 0
        return options.lr * 0.5 * (1 + math.cos(math.pi * k / steps))
    if k < options.warmup_steps:  # linear warmup from 0, then cosine down to min_lr_ratio x lr
        return options.lr * k / options.warmup_steps
    progress = (k - options.warmup_steps) / (steps - options.warmup_steps)
    return options.lr * (options.min_lr_ratio + (1 - options.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer_lrs(framework: str, optimizer) -> list[float]:
    if framework == "torch":
        return [group["lr"] for group in optimizer.param_groups]
    return [optimizer.get_lr()]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before `optimizer.step()`")
@pytest.mark.parametrize("framework", FRAMEWORK_PARAMS)
@pytest.mark.parametrize("name", ["fashion", "charlm"])
def test_glue_schedule_gives_the_script_learning_rate_at_every_step(name, framework):
    # Prepare: the script's optimizer and schedule over STEPS steps (every parameter group)
    workload = WORKLOADS[name]
    run = workload.prepare(framework, STEPS, TINY_ARGS[name])
    _, optimizer, schedule_step = workload.build(run)
    seen = []

    # Execute: read the rate, then step the schedule, as the scripts do once per step
    for _ in range(STEPS + 1):
        seen.append(_optimizer_lrs(framework, optimizer))
        schedule_step()

    # Assert: after k steps, the script's closed-form rate (warmup and cosine read from the script's options)
    groups = 2 if (name, framework) == ("charlm", "torch") else 1  # AdamW: decayed and undecayed groups
    for k, lrs in enumerate(seen[:STEPS + 1]):
        assert lrs == pytest.approx([_script_lr(name, run.options, k, STEPS)] * groups, rel=1e-6, abs=1e-12), k


@pytest.mark.parametrize("framework", FRAMEWORK_PARAMS)
@pytest.mark.parametrize("name", ["fashion", "charlm"])
def test_glue_trains_the_script_model_on_packed_rows_and_reports_its_metric(tmp_path, name, framework):
    # Prepare: a tiny packed slice; the script's arguments shrink the model
    data = _packed(name, tmp_path / name)
    workload = WORKLOADS[name]
    run = workload.prepare(framework, 6, TINY_ARGS[name])
    model, optimizer, schedule_step = workload.build(run)
    train, test = workload.load_train(run, str(data), 0, 1), workload.load_test(run)
    records: list[dict] = []
    before = workload.evaluate(run, model, test)

    # Execute: the runner's own loop, one process, the model unwrapped
    _zoo_ddp.train_loop(workload, run, model, model, optimizer, schedule_step, train, test, BATCH, 3,
                        seed=0, rank=0, report=records.append)

    # Assert: evaluations where the script reports them, the schedule at its end, the metric in range
    assert [r["step"] for r in records] == [3, 6] and [r["final"] for r in records] == [False, True]
    assert _optimizer_lrs(framework, optimizer)[0] == pytest.approx(_script_lr(name, run.options, 6, 6), abs=1e-9)
    after = records[-1][workload.metric]
    if name == "fashion":
        assert 0.0 <= after <= 1.0 and len(test[1]) == 64
    else:  # bits per byte: 8 for a uniform guess over 256 bytes, and the model learns fast on source code
        assert tuple(test.shape) == (2000 // 33, 33)
        assert before == pytest.approx(8.0, abs=0.5) and after < before


def _tiny_bench_workload(name: str, tmp_path: Path, steps: int, eval_every: int):
    """The workload with TINY_ARGS after its job's ``args:``, its packed slice and bench/zoo.py's settings."""
    workload = dataclasses.replace(WORKLOADS[name], script_args=tuple(TINY_ARGS[name]))
    settings = {"steps": steps, "batch_size": BATCH, "eval_every": eval_every, "seed": 0}
    return workload, _packed(name, tmp_path / name), settings


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORK_PARAMS)
@pytest.mark.parametrize("name", ["fashion", "charlm"])
def test_runner_loop_ends_at_the_metric_of_the_script_run_alone(tmp_path, name, framework):
    # Prepare: the workload with tiny script arguments (after the job's own), as bench/zoo.py passes them
    workload, data, s = _tiny_bench_workload(name, tmp_path, steps=6, eval_every=3)

    # Execute: the real script alone (a subprocess, bench/zoo.py's alone row), then the runner's loop here
    records, _, _ = zoo.run_alone(workload, framework, data, s, tmp_path)
    run = workload.prepare(framework, s["steps"], workload.args(framework))
    model, optimizer, schedule_step = workload.build(run)
    ours: list[dict] = []
    _zoo_ddp.train_loop(workload, run, model, model, optimizer, schedule_step, workload.load_train(run, str(data), 0, 1),
                        workload.load_test(run), BATCH, s["eval_every"], seed=0, rank=0, report=ours.append)

    # Assert: the same losses at the script's reports and the same final metric (the same weights, batches,
    # flips, optimizer and schedule)
    (final,) = [r for r in records if r.get("final")]
    script_losses = {int(r["step"]): r["loss"] for r in records if "loss" in r}
    assert script_losses == pytest.approx({r["step"]: r["loss"] for r in ours}, abs=2e-5)
    assert ours[-1][workload.metric] == pytest.approx(final[workload.metric], rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORK_PARAMS)
@pytest.mark.parametrize("name", ["fashion", "charlm"])
def test_collective_runner_trains_under_the_launcher_with_the_script_arguments(tmp_path, name, framework):
    # Prepare: 2 processes on gloo; charlm's 33-byte windows train only if --context 32 reaches every rank
    workload, data, s = _tiny_bench_workload(name, tmp_path, steps=4, eval_every=2)

    # Execute: bench/zoo.py's ddp row (hfleet launch, bench/_zoo_ddp.py)
    records, wall_s, _ = zoo.run_ddp(workload, framework, data, s, 2, tmp_path)

    # Assert: rank 0 evaluated where asked, with a loss and the workload's metric
    assert [r["step"] for r in records] == [2, 4] and records[-1]["final"] and wall_s > 0
    assert all(math.isfinite(r["loss"]) and math.isfinite(r[workload.metric]) for r in records)
