"""`hfleet image render/build`: Dockerfiles on official base tags, lock-derived tags, refusals."""

from __future__ import annotations

import copy
import os
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
    assert other.tag != first.tag and "numpy==2.3.0" in other.dockerfile


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
