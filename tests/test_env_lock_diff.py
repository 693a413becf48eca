"""`hfleet env lock` / `env diff`: the fingerprint, its hash, drift severities and exit codes."""

from __future__ import annotations

import copy
import importlib.metadata
import json
from pathlib import Path

import pytest

from hybridfleet.cli.app import main
from hybridfleet.env.diff import diff_locks
from hybridfleet.env.lock import LockFileError, lock_hash, make_lock, parse_image_ref, read_lock, write_lock
from hybridfleet.errors import EXIT_CODES, exit_code_for

SAMPLE = Path(__file__).parent / "expected" / "sample.lock.json"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def machine_lock() -> dict:
    return make_lock()


def _variant(tmp_path, name: str, change) -> str:
    lock = copy.deepcopy(read_lock(SAMPLE))
    change(lock)
    return str(write_lock(lock, tmp_path / name))


@pytest.mark.torch  # trains or probes torch
def test_lock_records_this_machine_and_hash_ignores_host_and_time(machine_lock):
    # Prepare
    lock = copy.deepcopy(machine_lock)
    # Assert: frameworks and distributions as importlib.metadata sees them
    assert lock["frameworks"]["torch"]["version"] == importlib.metadata.version("torch")
    assert lock["frameworks"]["paddle"]["version"] == importlib.metadata.version("paddlepaddle")
    assert lock["distributions"]["numpy"] == importlib.metadata.version("numpy")
    assert lock["hash"] == lock_hash(lock)
    # Execute: host facts and the time do not move the hash; a package does
    lock["host"]["hostname"] = "another-host"
    lock["created_at"] = "1999-01-01T00:00:00Z"
    assert lock_hash(lock) == machine_lock["hash"]
    lock["distributions"]["numpy"] = "0.0.1"
    assert lock_hash(lock) != machine_lock["hash"]


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_changing_a_framework_cuda_changes_the_hash(machine_lock, framework):
    lock = copy.deepcopy(machine_lock)
    lock["frameworks"][framework]["cuda"] = "12.6"
    assert lock_hash(lock) != machine_lock["hash"]


def test_lock_cli_writes_a_readable_lock_with_the_image_digest(tmp_path, capsys, monkeypatch):
    out = tmp_path / "hfleet.lock.json"
    monkeypatch.setenv("HFLEET_IMAGE", f"registry.example.com/digits@{DIGEST}")
    main(["env", "lock", "-o", str(out)])
    lock = read_lock(out)
    assert lock["image"] == {"ref": f"registry.example.com/digits@{DIGEST}", "digest": DIGEST}
    assert f"sha256 {lock['hash'][:12]}" in capsys.readouterr().out


def test_malformed_image_digest_is_refused():
    with pytest.raises(ValueError, match=r"image: digest must be sha256:<64 hex> \(got 'sha256:xyz'"):
        parse_image_ref("repo@sha256:xyz")


def test_same_lock_has_no_drift_and_exits_0(capsys):
    main(["env", "diff", str(SAMPLE), str(SAMPLE)])
    assert "describe the same environment" in capsys.readouterr().out


@pytest.mark.parametrize("framework,new_version", [("torch", "2.12.0+cpu"), ("paddle", "3.2.0")])
def test_framework_version_drift_is_an_error_and_exits_1(tmp_path, capsys, framework, new_version):
    # Prepare
    changed = _variant(tmp_path, "cloud.lock.json",
                       lambda lock: lock["frameworks"][framework].update(version=new_version))
    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "diff", str(SAMPLE), changed, "--json"])
    # Assert
    assert exit_info.value.code == EXIT_CODES["env_drift"].code == 1
    report = json.loads(capsys.readouterr().out)
    errors = [d for d in report["differences"] if d["severity"] == "error"]
    assert [d["path"] for d in errors] == [f"frameworks.{framework}.version"]
    assert errors[0]["b"] == new_version and report["counts"]["error"] == 1


def test_drift_error_message_names_each_difference(tmp_path, capsys):
    changed = _variant(tmp_path, "b.lock.json", lambda lock: lock["frameworks"]["torch"].update(cudnn="9.1.0"))
    with pytest.raises(SystemExit):
        main(["env", "diff", str(SAMPLE), changed])
    err = capsys.readouterr().err
    assert "1 error-level difference(s)" in err and "torch cuDNN only in B (9.1.0)" in err


def test_package_only_change_is_a_warning_and_exits_0(tmp_path, capsys):
    # Prepare: one package changed, one added
    def change(lock):
        lock["distributions"]["numpy"] = "2.3.0"
        lock["distributions"]["rich"] = "15.0.0"
    changed = _variant(tmp_path, "b.lock.json", change)
    # Execute
    main(["env", "diff", str(SAMPLE), changed, "--json"])
    # Assert
    report = json.loads(capsys.readouterr().out)
    assert {(d["path"], d["severity"]) for d in report["differences"]} == {
        ("distributions.numpy", "warning"), ("distributions.rich", "warning")}


def test_severity_rules_for_python_and_host_facts():
    a = read_lock(SAMPLE)
    b = copy.deepcopy(a)
    b["python"].update(version="3.11.9")
    b["host"]["hostname"] = "cloud-node-1"
    b["platform"]["glibc"] = "2.39"
    assert {(d.path, d.severity) for d in diff_locks(a, b)} == {
        ("python.version", "warning"), ("host.hostname", "info"), ("platform.glibc", "info")}
    b["python"].update(version="3.12.1", minor="3.12")
    assert ("python.minor", "error") in {(d.path, d.severity) for d in diff_locks(a, b)}


def test_truncated_lock_file_gives_a_clear_error(tmp_path, capsys):
    # Prepare
    truncated = tmp_path / "half.lock.json"
    text = SAMPLE.read_text()
    truncated.write_text(text[: len(text) // 2])
    # Execute / Assert: library
    with pytest.raises(LockFileError, match=r"not a valid lock file \(truncated or malformed JSON at line \d+"):
        read_lock(truncated)
    # Execute / Assert: CLI maps it through the exit-code table
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "diff", str(SAMPLE), str(truncated)])
    assert exit_info.value.code == exit_code_for(LockFileError("x")).code != 0
    assert f"regenerate it with `hfleet env lock -o {truncated}`" in capsys.readouterr().err


def test_hand_edited_missing_and_incomplete_locks_are_refused(tmp_path):
    edited = tmp_path / "edited.lock.json"
    lock = json.loads(SAMPLE.read_text())
    lock["distributions"]["numpy"] = "1.0.0"
    edited.write_text(json.dumps(lock))
    with pytest.raises(LockFileError, match="does not match the content"):
        read_lock(edited)
    with pytest.raises(LockFileError, match="no such lock file"):
        read_lock(tmp_path / "absent.json")
    del lock["frameworks"]
    edited.write_text(json.dumps(lock))
    with pytest.raises(LockFileError, match="missing key\\(s\\) frameworks"):
        read_lock(edited)
