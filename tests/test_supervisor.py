"""The local process supervisor, with real subprocesses and real signals."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hybridfleet.errors import LaunchError
from hybridfleet.launch.progress import ProgressReporter
from hybridfleet.launch.supervisor import ProcessSpec, Supervisor, stop_on_signals

PY = sys.executable
WAIT_S = 15.0


def _py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pid: int, timeout_s: float = WAIT_S) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


class Lines:
    """An ``on_line`` callback that records lines and lets a test wait for one."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self._cond = threading.Condition()

    def __call__(self, name: str, line: str) -> None:
        with self._cond:
            self.seen.append((name, line))
            self._cond.notify_all()

    def wait_for(self, name: str, prefix: str, timeout_s: float = WAIT_S) -> str:
        with self._cond:
            found = lambda: next((l for n, l in self.seen if n == name and l.startswith(prefix)), None)  # noqa: E731
            self._cond.wait_for(lambda: found() is not None, timeout_s)
            line = found()
        assert line is not None, f"{name} never printed {prefix!r}; saw {self.seen}"
        return line


def _events(sup: Supervisor, name: str, event: str) -> list[dict]:
    return [e for e in sup.events if e["process"] == name and e["event"] == event]


COUNTER_SCRIPT = """
    import os, sys
    from pathlib import Path
    counter = Path(sys.argv[1])
    runs = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(runs))
    print("run", runs, "restart_count", os.environ["HFLEET_RESTART_COUNT"])
    sys.exit(0 if runs >= int(sys.argv[2]) else 7)
"""


# ---- running and collecting ---------------------------------------------------


def test_three_processes_report_exit_codes_log_files_and_prefixed_echo(tmp_path):
    # Prepare
    echo = io.StringIO()
    lines = Lines()
    specs = [
        ProcessSpec("shard-0", _py("print('alpha out')"), role="shard"),
        ProcessSpec("worker-a", _py("import sys; print('beta err', file=sys.stderr); sys.exit(3)")),
        ProcessSpec("worker-b", _py("print('gamma 1'); print('gamma 2')"), env={"EXTRA": "x"}),
    ]

    # Execute
    with Supervisor(tmp_path, on_line=lines, stream=echo) as sup:
        for spec in specs:
            sup.start(spec)
        codes = sup.wait([s.name for s in specs])

    # Assert
    assert codes == {"shard-0": 0, "worker-a": 3, "worker-b": 0}
    assert (tmp_path / "logs" / "shard-0.log").read_text() == "alpha out\n"
    assert (tmp_path / "logs" / "worker-a.log").read_text() == "beta err\n"
    assert (tmp_path / "logs" / "worker-b.log").read_text() == "gamma 1\ngamma 2\n"
    echoed = echo.getvalue().splitlines()
    assert {"[shard-0] alpha out", "[worker-a] beta err", "[worker-b] gamma 1", "[worker-b] gamma 2"} == set(echoed)
    assert sorted(lines.seen) == [("shard-0", "alpha out"), ("worker-a", "beta err"), ("worker-b", "gamma 1"), ("worker-b", "gamma 2")]
    assert [e["returncode"] for e in _events(sup, "worker-a", "exit")] == [3]
    assert _events(sup, "worker-a", "gave_up") and not _events(sup, "shard-0", "gave_up")
    assert _events(sup, "shard-0", "start")[0]["role"] == "shard"


def test_events_are_written_to_events_jsonl_as_recorded(tmp_path):
    # Prepare
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(ProcessSpec("one", _py("pass")))

        # Execute
        sup.wait()

    # Assert
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert written == sup.events
    assert [e["event"] for e in written] == ["start", "exit"]
    assert set(written[0]) == {"ts", "process", "role", "event", "returncode", "attempt", "pid"}


def test_output_without_trailing_newline_still_arrives_as_a_line(tmp_path):
    # Prepare
    lines = Lines()
    with Supervisor(tmp_path, echo=False, on_line=lines) as sup:
        sup.start(ProcessSpec("partial", _py("import sys; sys.stdout.write('no newline')")))

        # Execute
        sup.wait()

    # Assert
    assert lines.seen == [("partial", "no newline")]


def test_on_line_that_raises_does_not_stop_logging(tmp_path):
    # Prepare
    def broken(name, line):
        raise RuntimeError("parser bug")

    with Supervisor(tmp_path, echo=False, on_line=broken) as sup:
        sup.start(ProcessSpec("chatty", _py("print('a'); print('b')")))

        # Execute
        codes = sup.wait()

    # Assert
    assert codes == {"chatty": 0}
    assert (tmp_path / "logs" / "chatty.log").read_text() == "a\nb\n"


# ---- restarts -------------------------------------------------------------------


def test_process_failing_twice_then_succeeding_ends_with_zero_after_two_restarts(tmp_path):
    # Prepare
    counter = tmp_path / "counter"
    spec = ProcessSpec("flaky", _py(COUNTER_SCRIPT) + [str(counter), "3"], max_restarts=2, restart_delay_s=0.05)

    # Execute
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(spec)
        codes = sup.wait(["flaky"])

    # Assert
    assert codes == {"flaky": 0}
    assert len(_events(sup, "flaky", "restart")) == 2
    assert [e["returncode"] for e in _events(sup, "flaky", "exit")] == [7, 7, 0]
    assert [e["attempt"] for e in _events(sup, "flaky", "start")] == [1, 2, 3]
    assert not _events(sup, "flaky", "gave_up")
    log = (tmp_path / "logs" / "flaky.log").read_text().splitlines()
    assert log == [
        "run 1 restart_count 0",
        "--- restart 1 ---",
        "run 2 restart_count 1",
        "--- restart 2 ---",
        "run 3 restart_count 2",
    ]


def test_process_failing_more_often_than_its_restarts_gives_up_with_its_code(tmp_path):
    # Prepare
    counter = tmp_path / "counter"
    spec = ProcessSpec("flaky", _py(COUNTER_SCRIPT) + [str(counter), "3"], max_restarts=1, restart_delay_s=0.05)

    # Execute
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(spec)
        codes = sup.wait(["flaky"])

    # Assert
    assert codes == {"flaky": 7}
    assert sup.returncode("flaky") == 7
    assert len(_events(sup, "flaky", "restart")) == 1
    assert [e["returncode"] for e in _events(sup, "flaky", "gave_up")] == [7]
    assert counter.read_text() == "2"


def test_process_killed_with_sigkill_is_restarted_when_it_has_restarts_left(tmp_path):
    # Prepare: the first attempt sleeps until killed, the restarted one exits 0.
    lines = Lines()
    code = """
        import os, time
        print("ready", flush=True)
        if os.environ["HFLEET_RESTART_COUNT"] == "0":
            time.sleep(60)
    """
    with Supervisor(tmp_path, echo=False, on_line=lines) as sup:
        sup.start(ProcessSpec("victim", _py(code), max_restarts=1, restart_delay_s=0.05))
        lines.wait_for("victim", "ready")
        first_pid = sup.pid("victim")

        # Execute
        sup.kill("victim")
        codes = sup.wait(["victim"])

    # Assert
    assert codes == {"victim": 0}
    assert [e["returncode"] for e in _events(sup, "victim", "exit")] == [-signal.SIGKILL, 0]
    assert len(_events(sup, "victim", "restart")) == 1
    assert _events(sup, "victim", "start")[1]["pid"] != first_pid


def test_process_killed_without_restarts_reports_the_signal_as_a_negative_code(tmp_path):
    # Prepare
    lines = Lines()
    with Supervisor(tmp_path, echo=False, on_line=lines) as sup:
        sup.start(ProcessSpec("victim", _py("import time; print('ready', flush=True); time.sleep(60)")))
        lines.wait_for("victim", "ready")

        # Execute
        sup.kill("victim", signal.SIGKILL)
        codes = sup.wait(["victim"])

    # Assert
    assert codes == {"victim": -signal.SIGKILL}
    assert sup.pid("victim") is None


@pytest.mark.timeout(20)
def test_stop_cancels_a_pending_restart(tmp_path):
    # Prepare: a long restart delay that stop() must not sit through.
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(ProcessSpec("failing", _py("raise SystemExit(5)"), max_restarts=3, restart_delay_s=60))
        deadline_s = time.monotonic() + WAIT_S
        while not _events(sup, "failing", "exit") and time.monotonic() < deadline_s:
            time.sleep(0.02)

        # Execute
        codes = sup.stop(grace_s=1.0)

    # Assert
    assert codes == {"failing": 5}
    assert not _events(sup, "failing", "restart")


# ---- stopping and orphans -------------------------------------------------------


def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace(tmp_path):
    # Prepare
    lines = Lines()
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """
    sup = Supervisor(tmp_path, echo=False, on_line=lines)
    sup.start(ProcessSpec("stubborn", _py(code)))
    lines.wait_for("stubborn", "ready")
    pid = sup.pid("stubborn")

    # Execute
    codes = sup.stop(grace_s=0.3)
    sup.close()

    # Assert
    assert codes == {"stubborn": -signal.SIGKILL}
    assert _events(sup, "stubborn", "stop")
    assert _gone(pid)


@pytest.mark.timeout(30)
def test_skip_grace_cuts_a_long_grace_short(tmp_path):
    # Prepare: a process ignoring SIGTERM and a stop with a grace far longer than the test.
    lines = Lines()
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """
    sup = Supervisor(tmp_path, echo=False, on_line=lines)
    sup.start(ProcessSpec("stubborn", _py(code)))
    lines.wait_for("stubborn", "ready")
    result: dict = {}
    stopper = threading.Thread(target=lambda: result.update(sup.stop(grace_s=600)))
    stopper.start()
    deadline_s = time.monotonic() + WAIT_S
    while not _events(sup, "stubborn", "stop") and time.monotonic() < deadline_s:
        time.sleep(0.02)

    # Execute
    sup.skip_grace()
    stopper.join(WAIT_S)
    sup.close()

    # Assert
    assert not stopper.is_alive()
    assert result == {"stubborn": -signal.SIGKILL}


def test_stop_terminates_the_whole_process_tree(tmp_path):
    # Prepare: a child that spawns a grandchild and prints its pid.
    lines = Lines()
    code = f"""
        import subprocess, time
        grandchild = subprocess.Popen([{PY!r}, "-c", "import time; time.sleep(60)"])
        print("grandchild", grandchild.pid, flush=True)
        time.sleep(60)
    """
    sup = Supervisor(tmp_path, echo=False, on_line=lines)
    sup.start(ProcessSpec("parent", _py(code)))
    grandchild_pid = int(lines.wait_for("parent", "grandchild").split()[1])
    child_pid = sup.pid("parent")
    assert not _gone(grandchild_pid)

    # Execute
    codes = sup.stop(grace_s=5.0)
    sup.close()

    # Assert
    assert codes == {"parent": -signal.SIGTERM}
    assert _gone(child_pid)
    assert _wait_gone(grandchild_pid)


def test_leftovers_of_an_exited_process_are_killed(tmp_path):
    # Prepare: the child starts a background grandchild and exits at once.
    lines = Lines()
    code = f"""
        import subprocess
        grandchild = subprocess.Popen([{PY!r}, "-c", "import time; time.sleep(60)"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("grandchild", grandchild.pid, flush=True)
    """
    with Supervisor(tmp_path, echo=False, on_line=lines) as sup:
        sup.start(ProcessSpec("leaver", _py(code)))

        # Execute
        codes = sup.wait(["leaver"])

    # Assert
    assert codes == {"leaver": 0}
    assert _wait_gone(int(lines.wait_for("leaver", "grandchild").split()[1]))


SUPERVISOR_SCRIPT = """
    import sys, time
    from pathlib import Path
    from hybridfleet.launch.supervisor import ProcessSpec, Supervisor, run_supervised
    sup = Supervisor(Path(sys.argv[1]), echo=False)
    for name in ("a", "b"):
        sup.start(ProcessSpec(name, [sys.executable, "-c", "import time; time.sleep(60)"]))
    print(sup.pid("a"), sup.pid("b"), flush=True)
    if sys.argv[2] == "wrapped":
        with sup:
            run_supervised(sup, lambda: (print("handlers installed", flush=True), sup.wait()), grace_s=5.0)
    else:
        time.sleep(60)
"""


def _start_supervisor_script(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = subprocess.Popen(_py(SUPERVISOR_SCRIPT) + [str(tmp_path), mode], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in script.stdout.readline().split()]
    assert len(pids) == 2, "the supervisor script did not report its children"
    return script, pids


@pytest.mark.slow
def test_supervisor_killed_by_sigkill_leaves_no_orphan(tmp_path):
    # Prepare
    script, child_pids = _start_supervisor_script(tmp_path, "bare")
    assert not any(_gone(pid) for pid in child_pids)

    # Execute
    script.kill()
    script.wait()
    script.stdout.close()

    # Assert: PR_SET_PDEATHSIG takes the children down with it.
    assert all(_wait_gone(pid) for pid in child_pids)


@pytest.mark.slow
@pytest.mark.parametrize("sig, expected_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_a_supervised_run_stops_all_children_and_exits_128_plus_signal(tmp_path, sig, expected_code):
    # Prepare
    script, child_pids = _start_supervisor_script(tmp_path, "wrapped")
    assert script.stdout.readline().strip() == "handlers installed"

    # Execute
    script.send_signal(sig)
    code = script.wait(timeout=WAIT_S)
    script.stdout.close()

    # Assert
    assert code == expected_code
    assert all(_gone(pid) for pid in child_pids)
    stops = [json.loads(l) for l in (tmp_path / "events.jsonl").read_text().splitlines() if '"stop"' in l]
    assert {e["process"] for e in stops} == {"a", "b"}


def test_stop_on_signals_off_the_main_thread_is_refused(tmp_path):
    # Prepare
    errors: list[BaseException] = []
    handler_before = signal.getsignal(signal.SIGTERM)

    def enter():
        try:
            with stop_on_signals(Supervisor(tmp_path, echo=False)):
                pass
        except RuntimeError as err:
            errors.append(err)

    # Execute
    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()

    # Assert
    assert len(errors) == 1 and "main thread" in str(errors[0])
    assert signal.getsignal(signal.SIGTERM) is handler_before


# ---- progress -------------------------------------------------------------------


def test_wait_with_progress_writes_plain_lines_when_not_a_terminal(tmp_path):
    # Prepare
    stream = io.StringIO()
    with Supervisor(tmp_path, echo=False, stream=stream) as sup:
        sup.start(ProcessSpec("short", _py("pass")))

        # Execute
        sup.wait(["short"], progress=lambda: (1, 4, "step 1"))

    # Assert
    assert stream.getvalue().splitlines() == ["progress: 1/4 (25%) step 1"]


def test_progress_bar_on_a_terminal_shows_the_description():
    # Prepare
    stream = io.StringIO()
    state = {"done": 0}

    # Execute
    with ProgressReporter(lambda: (state["done"], 10, "training shards"), stream=stream, terminal=True) as reporter:
        state["done"] = 5
        reporter.refresh()

    # Assert
    assert "training shards" in stream.getvalue()
    assert "50%" in stream.getvalue()


def test_failing_progress_function_does_not_break_wait(tmp_path):
    # Prepare
    def broken():
        raise KeyError("no metrics yet")

    with Supervisor(tmp_path, echo=False, stream=io.StringIO()) as sup:
        sup.start(ProcessSpec("short", _py("pass")))

        # Execute
        codes = sup.wait(progress=broken)

    # Assert
    assert codes == {"short": 0}


# ---- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "../escape", "argv": ["true"]}, "ProcessSpec.name: must be 1-128 letters"),
        ({"name": "", "argv": ["true"]}, "ProcessSpec.name: must be 1-128 letters"),
        ({"name": "w", "argv": []}, "ProcessSpec.argv of 'w': must be a non-empty list of strings (got [])"),
        ({"name": "w", "argv": ["x", 3]}, "ProcessSpec.argv of 'w': must be a non-empty list of strings"),
        ({"name": "w", "argv": ["x"], "env": {"A": 1}}, "ProcessSpec.env of 'w': keys and values must be strings"),
        ({"name": "w", "argv": ["x"], "max_restarts": -1}, "ProcessSpec.max_restarts of 'w': must be an integer >= 0 (got -1)"),
        ({"name": "w", "argv": ["x"], "restart_delay_s": -2}, "ProcessSpec.restart_delay_s of 'w': must be >= 0 (got -2)"),
    ],
)
def test_invalid_process_spec_is_rejected_with_the_field_named(kwargs, message):
    # Execute / Assert
    with pytest.raises(ValueError) as err:
        ProcessSpec(**kwargs)
    assert message in str(err.value)


def test_missing_executable_raises_launch_error_and_records_nothing(tmp_path):
    # Prepare
    sup = Supervisor(tmp_path, echo=False)

    # Execute
    with pytest.raises(LaunchError) as err:
        sup.start(ProcessSpec("ghost", ["/nonexistent/hfleet-no-such-binary"]))
    sup.close()

    # Assert
    assert "cannot start 'ghost': '/nonexistent/hfleet-no-such-binary'" in str(err.value)
    assert sup.events == []
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match="unknown process name 'ghost'"):
        sup.pid("ghost")


def test_missing_working_directory_raises_launch_error(tmp_path):
    # Execute / Assert
    with Supervisor(tmp_path, echo=False) as sup:
        with pytest.raises(LaunchError, match="working directory '/nonexistent/dir' does not exist"):
            sup.start(ProcessSpec("w", _py("pass"), cwd="/nonexistent/dir"))
        assert sup.events == []


def test_duplicate_process_name_is_rejected_and_the_first_keeps_running(tmp_path):
    # Prepare
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(ProcessSpec("w", _py("import time; time.sleep(60)")))
        first_pid = sup.pid("w")

        # Execute
        with pytest.raises(ValueError) as err:
            sup.start(ProcessSpec("w", _py("pass")))

        # Assert
        assert "a process named 'w' was already started" in str(err.value)
        assert sup.pid("w") == first_pid
        assert len(_events(sup, "w", "start")) == 1


def test_wait_for_an_unknown_name_names_it_and_the_known_ones(tmp_path):
    # Prepare
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(ProcessSpec("real", _py("pass")))

        # Execute / Assert
        with pytest.raises(ValueError, match=r"unknown process name\(s\) \['nope'\]; started: \['real'\]"):
            sup.wait(["real", "nope"])


def test_wait_timeout_names_the_processes_still_running_and_leaves_them_running(tmp_path):
    # Prepare
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(ProcessSpec("slow", _py("import time; time.sleep(60)")))

        # Execute
        with pytest.raises(TimeoutError) as err:
            sup.wait(["slow"], timeout_s=0.2)

        # Assert
        assert "processes still running after 0.2 s: ['slow']" in str(err.value)
        assert sup.pid("slow") is not None and sup.returncode("slow") is None


def test_kill_of_a_finished_process_and_bad_arguments_are_rejected(tmp_path):
    # Prepare
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(ProcessSpec("done", _py("pass")))
        sup.wait()

        # Execute / Assert
        with pytest.raises(ValueError, match=r"process 'done' is not running \(final code 0\)"):
            sup.kill("done")
        with pytest.raises(ValueError, match="kill\\(\\): 999 is not a signal number"):
            sup.kill("done", 999)
        with pytest.raises(ValueError, match=r"grace_s: must be >= 0 \(got -1\)"):
            sup.stop(grace_s=-1)


def test_a_stopped_supervisor_refuses_new_processes(tmp_path):
    # Prepare
    sup = Supervisor(tmp_path, echo=False)
    sup.stop()

    # Execute / Assert
    with pytest.raises(RuntimeError, match="this supervisor was stopped; create a new one"):
        sup.start(ProcessSpec("late", _py("pass")))
    sup.close()


def test_run_dir_that_cannot_be_written_raises_launch_error_and_registers_nothing(tmp_path):
    # Prepare: the run directory would have to live below a regular file.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    sup = Supervisor(blocker / "run", echo=False)

    # Execute
    with pytest.raises(LaunchError) as err:
        sup.start(ProcessSpec("w", _py("import time; time.sleep(60)")))
    sup.close()

    # Assert
    assert f"cannot start 'w': cannot write under {blocker / 'run'}" in str(err.value)
    with pytest.raises(ValueError, match="unknown process name 'w'"):
        sup.returncode("w")
