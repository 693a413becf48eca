"""The job's model checkpoint is written in the background: the same files as a synchronous
save, a step that does not wait for the writer, and a failed write that is raised, never lost.

Real torch / paddle models, real TLS shards on 127.0.0.1 (workers as threads of this process),
real file stores; a store whose writes wait on an Event holds a write in flight.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import script_optim_helpers as h
from hybridfleet.ckpt import list_checkpoints, load_checkpoint
from hybridfleet.ckpt.run_model import ModelCheckpointer
from hybridfleet.errors import EXIT_CODES, CheckpointError
from tests.ckpt_helpers import GatedStore

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)]


def _helpers(framework: str):
    """(the script's helpers, the hybridfleet adapter) of one framework."""
    return importlib.import_module(f"script_optim_{framework}"), importlib.import_module(f"hybridfleet.{framework}")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _unwritable(tmp_path: Path) -> str:
    """A model root whose blob folder cannot be created (a regular file stands in its place), even for root."""
    root = tmp_path / "model"
    root.mkdir()
    (root / "blobs").write_text("not a folder")
    return str(root)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_background_saves_write_the_same_files_as_synchronous_saves(tmp_path, monkeypatch, framework):
    # Prepare: one clock for both runs, so both stamp the same creation time
    monkeypatch.setattr(time, "time", lambda: 1_790_000_000.0)
    f, _ = _helpers(framework)

    def run(root: str, background: bool) -> None:
        m = f.model()
        opt, sched = f.make("adam", m)
        ckpt = ModelCheckpointer(root, framework, every_steps=2, keep_last=2, keep_best="acc", background=background)
        for step in range(1, 8):
            f.train(m, opt, sched, h.batches(step, 1))
            ckpt.after_step(step, m)
            if step in (3, 5, 6):
                ckpt.on_metrics(step, m, {"acc": {3: 0.5, 5: 0.9, 6: 0.7}[step]})
        ckpt.final(7, m, {"acc": 0.8})
        ckpt.close()

    # Execute
    run(str(tmp_path / "sync"), background=False)
    run(str(tmp_path / "async"), background=True)
    # Assert: byte for byte, retention included (last two, the best at step 5, the final)
    sync, background = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sorted(sync) == sorted(background)
    for name in sync:
        assert sync[name] == background[name], name
    assert [c.step for c in list_checkpoints(str(tmp_path / "async"))] == [5, 6, 7]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_ps_step_does_not_wait_for_the_model_writer(tmp_path, framework):
    # Prepare: rank 0's model checkpointer on a store whose writes wait for the gate
    f, hf = _helpers(framework)
    cluster = h.start_shards(tmp_path, h.job(framework))
    store = GatedStore(tmp_path / "model")
    m = f.model()
    opt, sched = f.make("adam", m)
    ps = hf.connect(m, opt, config=cluster.config(0))
    # the launcher's HFLEET_MODEL_DIR builds the same checkpointer on a plain file store
    ps._model_ckpt = ModelCheckpointer(store, framework, every_steps=3, background=True)
    at_step_3 = {}

    def keep(i, model, _opt):
        if i == 3:
            at_step_3.update(f.values(model))

    try:
        # Execute: step 3 starts a write that cannot finish; steps 4 and 5 go on
        f.train(m, opt, sched, h.batches(0, 5), ps=ps, on_step=keep)
        # Assert: five steps taken with the write still held, nothing on disk yet
        assert ps.step_count == 5 and ps._model_ckpt._writer.busy
        assert list_checkpoints(str(tmp_path / "model")) == []
        store.gate.set()
        ps.close()
    finally:
        store.gate.set()
        cluster.stop()
    # Assert: the step-3 checkpoint holds the values of step 3 (copied when it was due), the final those of step 5
    assert [c.step for c in list_checkpoints(str(tmp_path / "model"))] == [3, 5]
    target = f.model(seed=1)
    load_checkpoint(str(tmp_path / "model"), step=3, model=target)
    for name, value in f.values(target).items():
        assert np.array_equal(value, at_step_3[name]), name


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_failed_model_write_is_raised_at_the_next_step_before_anything_is_sent(tmp_path, framework):
    # Prepare
    f, hf = _helpers(framework)
    cluster = h.start_shards(tmp_path, h.job(framework))
    m = f.model()
    opt, sched = f.make("adam", m)
    ps = hf.connect(m, opt, config=cluster.config(0))
    ps._model_ckpt = ModelCheckpointer(_unwritable(tmp_path), framework, every_steps=2, background=True)
    try:
        f.train(m, opt, sched, h.batches(0, 2), ps=ps)  # step 2's write fails in the background
        ps._model_ckpt._writer._join()
        before, version = f.values(m), cluster.status()[0]["version"]
        # Execute / Assert: the next step raises, having sent nothing
        with pytest.raises(CheckpointError, match="background checkpoint write of step 2 failed"):
            f.train(m, opt, sched, h.batches(9, 1), ps=ps)
        assert cluster.status()[0]["version"] == version
        for name, value in f.values(m).items():
            assert np.array_equal(value, before[name]), name
        # close() saves the final model, which cannot be written either: raised, after leaving the job
        with pytest.raises(CheckpointError, match="background checkpoint write of step 2 failed"):
            ps.close()
        assert ps.session.client is None
    finally:
        cluster.stop()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_whose_model_failed_to_save_exits_non_zero_with_one_line(tmp_path, framework):
    # Prepare: a worker-like process (hybridfleet's excepthook) whose model root cannot take a write
    root = _unwritable(tmp_path)
    model = ("import torch; m = torch.nn.Linear(3, 2)" if framework == "torch"
             else "import paddle; m = paddle.nn.Linear(3, 2)")
    code = (f"{model}\nfrom hybridfleet.errors import install_excepthook\n"
            "from hybridfleet.ckpt.run_model import ModelCheckpointer\ninstall_excepthook()\n"
            f"c = ModelCheckpointer({root!r}, {framework!r}, every_steps=1, background=True)\n"
            "c.after_step(1, m)\nc.final(2, m)\nprint('finished')\n")
    # Execute
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO))
    # Assert
    assert result.returncode == EXIT_CODES["checkpoint"].code and "finished" not in result.stdout
    assert "background checkpoint write of step 1 failed" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
