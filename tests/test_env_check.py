"""`hfleet env check`: host and framework facts, a real 2-process all-reduce, exit codes 3/4/5."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from hybridfleet.cli.app import main
from hybridfleet.env.check import check_environment
from hybridfleet.errors import EXIT_CODES

FRAMEWORKS = ["torch", "paddle"]
DISTRIBUTION = {"torch": "torch", "paddle": "paddlepaddle"}
TOP_KEYS = {"python", "os", "hostname", "cpu", "memory", "gpus", "frameworks", "gpu_required", "problems", "ok"}
FRAMEWORK_KEYS = {"installed", "version", "cuda_compiled", "cuda", "cudnn", "nccl", "devices", "backends", "smoke"}
# These tests check the "GPU required but absent" answer; on a machine with NVIDIA GPUs (nvidia-smi
# on PATH) that answer cannot occur, and the GPU path is what runs instead.
no_gpu_here = pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                                 reason="checks the no-GPU error; nvidia-smi is on this machine, so GPUs may be present")


def _job(tmp_path, framework: str, **sections) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "digits", "framework": framework, "entrypoint": "train.py", **sections}))
    return str(path)


@pytest.mark.torch  # trains or probes torch
@pytest.mark.slow
def test_check_json_reports_documented_keys_and_a_real_all_reduce_for_both_frameworks(capsys):
    # Prepare / Execute
    main(["env", "check", "--json"])
    report = json.loads(capsys.readouterr().out)
    # Assert
    assert TOP_KEYS <= set(report)
    assert report["ok"] is True and report["problems"] == []
    assert report["cpu"]["logical_cores"] == os.cpu_count()
    for name in FRAMEWORKS:
        facts = report["frameworks"][name]
        assert FRAMEWORK_KEYS <= set(facts)
        assert facts["version"].split("+")[0] == importlib.metadata.version(DISTRIBUTION[name]).split("+")[0]
        assert facts["backends"]["gloo"] is True
        smoke = facts["smoke"]
        assert smoke["ok"] is True and smoke["backend"] == "gloo"
        assert smoke["world_size"] == 2 and smoke["value"] == 1.0 + 2.0  # ranks contribute 1 and 2


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_check_table_names_the_framework_and_its_installed_version(capsys, framework):
    main(["env", "check", "--framework", framework, "--no-smoke"])
    out = capsys.readouterr().out
    assert framework in out
    assert importlib.metadata.version(DISTRIBUTION[framework]).split("+")[0] in out
    assert "skipped" in out


@no_gpu_here
@pytest.mark.parametrize("framework,sections", [
    ("torch", {"resources": {"gpus": 1}}),
    ("paddle", {"environment": {"device": "gpu"}}),
])
def test_job_asking_for_a_gpu_exits_4_when_none_is_visible(tmp_path, capsys, framework, sections):
    # Prepare: this machine has no GPU, so the requirement genuinely fails
    job = _job(tmp_path, framework, **sections)
    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "check", "--job", job, "--no-smoke"])
    # Assert
    assert exit_info.value.code == EXIT_CODES["gpu_required"].code == 4
    err = capsys.readouterr().err
    assert "the job asks for 1 GPU(s) but 0 is visible" in err
    assert f"{framework}: 0 CUDA device(s)" in err
    assert "hint: the job asks for GPUs" in err


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_missing_framework_exits_3_with_install_hint(framework):
    # Prepare: a None entry in sys.modules makes the framework unimportable in
    # this child process only, the same as it not being installed.
    code = (f"import sys; sys.modules[{framework!r}] = None; "
            f"from hybridfleet.cli.app import main; main(['env', 'check', '--framework', {framework!r}])")
    # Execute
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    # Assert
    assert out.returncode == EXIT_CODES["framework_missing"].code == 3
    assert f"{framework} is not installed" in out.stderr
    assert "hint: install the framework" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_smoke_test_past_its_timeout_is_killed_and_exits_5(capsys, framework):
    # Prepare: no Python process imports a framework and joins a group in 10 ms
    timeout = "0.01"
    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "check", "--framework", framework, "--json", "--timeout-s", timeout])
    # Assert
    assert exit_info.value.code == EXIT_CODES["collective_smoke"].code == 5
    captured = capsys.readouterr()
    assert f"{framework} all-reduce smoke test (gloo, 2 processes) timed out after 0.01 s" in captured.err
    report = json.loads(captured.out)
    assert report["ok"] is False and report["frameworks"][framework]["smoke"]["ok"] is False


def test_unknown_framework_or_bad_bounds_are_refused_before_any_work():
    with pytest.raises(ValueError, match=r"framework must be one of \['paddle', 'torch'\] \(got 'jax'\)"):
        check_environment(["jax"])
    with pytest.raises(ValueError, match=r"timeout_s: must be > 0 \(got 0\)"):
        check_environment(["torch"], timeout_s=0)
    with pytest.raises(ValueError, match=r"gpus_required: must be >= 0 \(got -1\)"):
        check_environment(["torch"], gpus_required=-1)


def test_cli_rejects_an_unknown_framework_name(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # keep the usage error on one line
    with pytest.raises(SystemExit) as exit_info:
        main(["env", "check", "--framework", "jax"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Invalid value for '--framework'" in err and "'jax' is not one of 'torch', 'paddle'" in err


def test_importing_the_cli_and_env_modules_imports_neither_framework():
    code = ("import sys, hybridfleet.cli.app, hybridfleet.env.check, hybridfleet.env.lock, hybridfleet.env.diff, "
            "hybridfleet.env.dockerfile, hybridfleet.env.docker; "
            "print(sorted(m for m in ('torch', 'paddle') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch), "paddle"])
def test_a_process_probes_a_framework_once_per_child_environment(framework, monkeypatch):
    from hybridfleet.env import probe

    # Prepare: count the probe children this process starts
    started: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(argv, *args, **kwargs):
        started.append(list(argv))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(probe.subprocess, "run", counting_run)
    monkeypatch.setenv("HFLEET_TEST_PROBE_ONCE", framework)  # a child environment no earlier probe used
    # Execute
    first = probe.probe_framework(framework)
    first["version"] = "changed by the caller"  # a caller's copy: the kept facts stay as probed
    second = probe.probe_framework(framework)
    monkeypatch.setenv("HFLEET_TEST_PROBE_ONCE", framework + "-again")
    third = probe.probe_framework(framework)
    # Assert: one child per child environment, the same facts each time
    assert len(started) == 2 and all(argv[-1] == framework for argv in started)
    installed = importlib.metadata.version(DISTRIBUTION[framework])
    assert second == third and second["version"].split("+")[0] == installed.split("+")[0]
