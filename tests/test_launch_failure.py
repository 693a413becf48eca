"""Reading a failed attempt: which rank failed, with what exit code, and its last log lines."""

from __future__ import annotations

from hybridfleet.launch.failure import diagnose

TORCH_REPORT = """\
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
"""
PADDLE_REPORT = "Container rank 0 status failed cmd ['python', '-u', 't.py'] code -6 log log/workerlog.0\n"


def test_torch_root_cause_names_the_global_rank_exit_code_and_its_log_lines(tmp_path):
    # Prepare: torchrun's per-rank layout
    rank_dir = tmp_path / "run_abc" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text("step 1\nstep 2\nabout to fail\n")
    (rank_dir / "stderr.log").write_text("")

    # Execute
    failure = diagnose("torch", TORCH_REPORT, tmp_path, node_rank=1, nproc_per_node=2)

    # Assert
    assert (failure.rank, failure.local_rank, failure.exit_code) == (3, 1, -9)
    assert failure.last_lines[-1] == "about to fail"
    assert "rank 3 failed with exit code -9 (killed by signal 9)" in failure.describe()


TORCH_PEER_FIRST = """\
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
"""


def test_torch_rank_that_only_lost_its_peer_is_not_blamed_when_the_report_lists_the_killed_one(tmp_path):
    # Prepare: rank 0 exited first (gloo lost its peer); rank 1 was SIGKILLed
    for rank, text in ((0, "epoch 3\nRuntimeError: [gloo] Connection reset by peer\n"), (1, "epoch 3\n")):
        rank_dir = tmp_path / "run_abc" / "attempt_0" / str(rank)
        rank_dir.mkdir(parents=True)
        (rank_dir / "stderr.log").write_text(text)

    # Execute
    failure = diagnose("torch", TORCH_PEER_FIRST, tmp_path, node_rank=0, nproc_per_node=2)
    root_only = "Root Cause" + TORCH_PEER_FIRST.split("Root Cause")[1]
    without_list = diagnose("torch", root_only, tmp_path, node_rank=0, nproc_per_node=2)

    # Assert
    assert (failure.rank, failure.local_rank, failure.exit_code) == (1, 1, -9)
    assert (without_list.rank, without_list.local_rank, without_list.exit_code) == (1, 1, None)  # from the logs


def test_paddle_rank_that_only_lost_its_peer_is_not_blamed(tmp_path):
    # Prepare: paddle reports rank 0, whose log shows it lost rank 1; rank 1's log does not
    (tmp_path / "workerlog.0").write_text("epoch 1\nRead error [127.0.0.1]:1234: Connection reset by peer\n")
    (tmp_path / "workerlog.1").write_text("epoch 1\n")

    # Execute
    failure = diagnose("paddle", PADDLE_REPORT, tmp_path, node_rank=0, nproc_per_node=2)

    # Assert
    assert (failure.rank, failure.exit_code) == (1, None)
    assert [p.name for p in failure.log_files] == ["workerlog.1"]


def test_paddle_reported_rank_stands_when_its_log_shows_no_lost_peer(tmp_path):
    (tmp_path / "workerlog.0").write_text("Traceback\nValueError: bad batch\n")
    (tmp_path / "workerlog.1").write_text("epoch 1\n")
    failure = diagnose("paddle", PADDLE_REPORT, tmp_path, node_rank=1, nproc_per_node=2)
    assert (failure.rank, failure.local_rank, failure.exit_code) == (2, 0, -6)
    assert failure.last_lines == ["Traceback", "ValueError: bad batch"]


def test_unrecognised_launcher_output_reports_an_unknown_rank(tmp_path):
    failure = diagnose("torch", "Segmentation fault\n", tmp_path, node_rank=0, nproc_per_node=2)
    assert (failure.rank, failure.exit_code, failure.log_files) == (None, None, [])
    assert failure.describe().startswith("a rank failed with unknown exit code; logs: no log file found")
