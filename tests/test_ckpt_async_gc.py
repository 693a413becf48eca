"""Async saves (one in flight, stall measured, nothing lost silently), retention/gc, and `hfleet ckpt`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt import AsyncCheckpointer, gc, list_checkpoints, load_tensors_checkpoint, save_tensors_checkpoint, verify
from hybridfleet.cli.app import main as cli_main
from hybridfleet.errors import CheckpointError
from hybridfleet.store.file import FileStore
from tests.ckpt_helpers import GatedStore

REPO = Path(__file__).resolve().parents[1]


class FailingStore(FileStore):
    def _put_parts(self, path, parts):
        raise OSError("disk full")


def tensors(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((32, 32), value, dtype=np.float32), "b": np.full(4, value, dtype=np.float32)}


def test_async_save_snapshots_at_call_time_and_reports_stall(tmp_path):
    # Prepare
    data = tensors(1.0)
    # Execute
    with AsyncCheckpointer(str(tmp_path)) as saver:
        stall_s = saver.save(1, tensors=data, state={"k": 1})
        data["w"][:] = 99.0  # training continues and mutates its arrays
        info = saver.wait()
    # Assert
    assert stall_s is not None and stall_s >= 0 and info.step == 1 and info.stall_s == stall_s
    _, loaded, state = load_tensors_checkpoint(tmp_path)
    np.testing.assert_array_equal(loaded["w"], tensors(1.0)["w"])
    assert state == {"k": 1}


def test_second_save_is_refused_while_one_is_in_flight(tmp_path):
    store = GatedStore(tmp_path)
    saver = AsyncCheckpointer(store, if_busy="refuse")

    first = saver.save(1, tensors=tensors(1.0))
    second = saver.save(2, tensors=tensors(2.0))
    store.gate.set()
    saver.close()

    assert first is not None and second is None
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]


def test_second_save_waits_for_the_first_by_default(tmp_path):
    store = GatedStore(tmp_path)
    saver = AsyncCheckpointer(store)
    saver.save(1, tensors=tensors(1.0))
    store.gate.set()

    saver.save(2, tensors=tensors(2.0))
    saver.close()

    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]


def test_failed_background_write_is_raised_on_wait():
    saver = AsyncCheckpointer(FailingStore("/tmp/unused-failing-store"))
    saver.save(3, tensors=tensors(1.0))

    with pytest.raises(CheckpointError, match="background checkpoint write of step 3 failed: disk full"):
        saver.wait()


def test_async_saver_applies_retention_after_each_save(tmp_path):
    with AsyncCheckpointer(str(tmp_path), keep_last=2) as saver:
        for step in range(1, 5):
            saver.save(step, tensors=tensors(float(step)))

    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]
    assert all(r.ok for r in verify(tmp_path))


def test_bad_if_busy_value_is_rejected():
    with pytest.raises(ValueError, match="if_busy must be one of"):
        AsyncCheckpointer("/tmp/unused", if_busy="drop")


def test_exit_with_write_still_in_flight_logs_the_lost_step(tmp_path):
    # A child process whose only checkpoint write never completes before exit.
    code = f"""
import numpy as np
from hybridfleet.ckpt import AsyncCheckpointer
from tests.test_ckpt_async_gc import GatedStore
saver = AsyncCheckpointer(GatedStore({str(tmp_path)!r}), exit_timeout_s=0.2)
saver.save(42, tensors={{"w": np.zeros(3, np.float32)}})
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(REPO))

    lost = [json.loads(line) for line in result.stderr.splitlines() if '"checkpoint_lost"' in line]
    assert result.returncode == 0, result.stderr[-2000:]
    assert lost and lost[0]["step"] == 42


def save_series(root, count: int, accs: list[float]) -> None:
    for step in range(1, count + 1):
        save_tensors_checkpoint(root, step, tensors(float(step)), metrics={"acc": accs[step - 1]})


def test_gc_keeps_last_n_and_best_and_removes_unreferenced_blobs(tmp_path):
    save_series(tmp_path, 6, [0.1, 0.9, 0.3, 0.4, 0.5, 0.6])
    blobs_before = len(list((tmp_path / "blobs" / "sha256").iterdir()))

    result = gc(tmp_path, keep_last=2, best_metric="acc")

    assert result.kept_steps == [2, 5, 6] and result.removed_steps == [1, 3, 4]
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 5, 6]
    assert all(r.ok for r in verify(tmp_path))
    assert len(list((tmp_path / "blobs" / "sha256").iterdir())) == blobs_before - result.removed_blobs
    assert result.removed_blobs > 0


def test_gc_never_removes_newest_valid_checkpoint(tmp_path):
    save_series(tmp_path, 3, [0.5, 0.5, 0.5])
    newest = list_checkpoints(tmp_path)[-1]
    blob = tmp_path / next(f.path for f in newest.files if f.role == "tensors")
    blob.write_bytes(b"garbage")

    result = gc(tmp_path, keep_last=1)

    assert 2 in result.kept_steps
    assert load_tensors_checkpoint(tmp_path)[0] == 2


def test_gc_leaves_blobs_alone_while_a_save_is_in_flight(tmp_path):
    save_series(tmp_path, 2, [0.5, 0.5])
    (tmp_path / "step-000000000003").mkdir()  # a newer save without its manifest yet
    (tmp_path / "blobs" / "sha256" / ("f" * 64)).write_bytes(b"new blob of the save in flight")

    result = gc(tmp_path, keep_last=1)

    assert result.removed_steps == [1] and result.removed_blobs == 0
    assert (tmp_path / "blobs" / "sha256" / ("f" * 64)).exists()


def test_gc_rejects_keep_last_below_one(tmp_path):
    with pytest.raises(ValueError, match=r"keep_last must be >= 1 \(got 0\)"):
        gc(tmp_path, keep_last=0)


def run_cli(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
        sys.exit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_cli_ls_show_verify_and_gc(tmp_path, capsys):
    save_series(tmp_path, 3, [0.2, 0.8, 0.4])

    ls_code, ls_out, _ = run_cli(["ckpt", "ls", str(tmp_path)], capsys)
    show_code, show_out, _ = run_cli(["ckpt", "show", str(tmp_path), "--step", "2"], capsys)
    verify_code, verify_out, _ = run_cli(["ckpt", "verify", str(tmp_path)], capsys)
    gc_code, gc_out, _ = run_cli(["ckpt", "gc", str(tmp_path), "--keep-last", "1", "--best-metric", "acc"], capsys)

    assert (ls_code, show_code, verify_code, gc_code) == (0, 0, 0, 0)
    assert ls_out.splitlines()[0].split() == ["STEP", "FRAMEWORK", "SIZE", "AGE", "STATUS", "METRICS"]
    assert [line.split()[0] for line in ls_out.splitlines()[1:]] == ["1", "2", "3"]
    assert all(" ok " in line for line in ls_out.splitlines()[1:])
    shown = json.loads(show_out)
    assert shown["step"] == 2 and shown["metrics"] == {"acc": 0.8} and shown["tensors"]["w"]["shape"] == [32, 32]
    assert verify_out.split() == ["1", "ok", "2", "ok", "3", "ok"]
    assert "kept steps [2, 3]" in gc_out and "removed steps [1]" in gc_out


def test_cli_show_and_verify_take_one_step_folder_for_that_step(tmp_path, capsys):
    save_series(tmp_path, 3, [0.2, 0.8, 0.4])
    folder = str(tmp_path / "step-000000000002")

    show_code, show_out, _ = run_cli(["ckpt", "show", folder], capsys)
    verify_code, verify_out, _ = run_cli(["ckpt", "verify", folder + "/"], capsys)
    clash_code, _, clash_err = run_cli(["ckpt", "show", folder, "--step", "3"], capsys)

    assert (show_code, verify_code) == (0, 0)
    assert json.loads(show_out)["step"] == 2
    assert verify_out.split() == ["2", "ok"]
    assert clash_code == 2 and "is the folder of step 2, but --step 3 was given" in clash_err


def corrupt_newest(root) -> None:
    """Replace the tensor file of the newest checkpoint under ``root`` with one byte."""
    newest = list_checkpoints(root)[-1]
    (root / next(f.path for f in newest.files if f.role == "tensors")).write_bytes(b"x")


def test_cli_verify_of_corrupt_checkpoint_exits_with_checkpoint_code(tmp_path, capsys):
    save_series(tmp_path, 2, [0.5, 0.5])
    corrupt_newest(tmp_path)

    code, out, err = run_cli(["ckpt", "verify", str(tmp_path)], capsys)

    assert code == 11
    assert "INVALID" in out and "1 of 2 checkpoints are invalid (steps [2]); the newest valid one is step 1" in err


def test_cli_verify_with_no_valid_checkpoint_says_so_in_words(tmp_path, capsys):
    save_series(tmp_path, 1, [0.5])
    corrupt_newest(tmp_path)

    code, _, err = run_cli(["ckpt", "verify", str(tmp_path)], capsys)

    assert code == 11 and "none is valid" in err and "None" not in err


def test_cli_ls_marks_a_corrupt_step(tmp_path, capsys):
    save_series(tmp_path, 2, [0.5, 0.5])
    corrupt_newest(tmp_path)

    code, out, _ = run_cli(["ckpt", "ls", str(tmp_path)], capsys)

    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert " ok " in rows["1"] and "CORRUPT" in rows["2"]


def test_cli_ls_of_a_missing_folder_fails_with_the_checkpoint_code(tmp_path, capsys):
    code, out, err = run_cli(["ckpt", "ls", str(tmp_path / "nope")], capsys)

    assert code == 11 and out == ""
    assert "no checkpoints under" in err and "hint: check the path" in err
    assert not (tmp_path / "nope").exists()
