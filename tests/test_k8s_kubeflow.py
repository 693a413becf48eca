"""Collective jobs on Kubeflow: v1 PyTorchJob/PaddleJob and Trainer v2 TrainJob, against what the operators inject.

`INJECTED` is read from tests/schemas/kubeflow/OPERATORS.md (the operators' sources): a
rendered command may only reference variables its operator sets for that pod shape, and
it must parse with the real `hfleet launch` once they are expanded.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import typer.main
import yaml

from hybridfleet.errors import SpecError
from hybridfleet.k8s.common import RenderOptions
from hybridfleet.k8s.render import render_job_file
from tests.kubeflow_schemas import CRD_FILES, crd_schema

# What each operator sets in the training container (OPERATORS.md sections 2, 3 and 5), with sample values.
INJECTED = {
    "pytorch-master": {"MASTER_ADDR": "ddp-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "3",
                       "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1"},
    "pytorch-elastic": {"PET_RDZV_ENDPOINT": "ddp-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
                        "PET_NNODES": "2:4", "PET_NPROC_PER_NODE": "2"},
    "paddle": {"PADDLE_JOB_ID": "ddp", "PADDLE_NNODES": "3", "PADDLE_MASTER": "ddp-worker-0:36543"},
    "trainjob": {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "2",
                 "PET_MASTER_ADDR": "ddp-node-0-0.ddp", "PET_MASTER_PORT": "29500"},
}


def _job(tmp_path: Path, framework: str, nnodes: str = "3", **extra) -> Path:
    job = {"name": "ddp", "framework": framework, "entrypoint": f"examples/collective/train_{framework}.py",
           "mode": "collective", "collective": {"nproc_per_node": 2, "nnodes": nnodes},
           "environment": {"image": "registry.example.com/hfleet/ddp:2.0"}, **extra}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _launch_params(command: list[str], env: dict[str, str], repo_root: Path) -> dict:
    """Expand $(VAR) from ``env`` (failing on any variable the operator does not set) and parse `hfleet launch`."""
    from hybridfleet.cli.app import app

    args = []
    for arg in command[1:]:
        for var, value in env.items():
            arg = arg.replace(f"$({var})", value)
        assert "$(" not in arg, f"{arg!r} references a variable the operator does not inject"
        args.append(arg)
    cli = typer.main.get_command(app)
    launch = cli.get_command(cli.make_context("hfleet", list(args)), "launch")
    return launch.make_context("launch", args[1:]).params


@pytest.mark.parametrize(("framework", "nnodes", "api", "shape"), [
    ("torch", "3", "v1", "pytorch-master"),
    ("torch", "2:4", "v1", "pytorch-elastic"),
    ("paddle", "3", "v1", "paddle"),
    ("torch", "3", "v2", "trainjob"),
])
def test_rendered_command_uses_only_what_the_operator_injects_and_parses(tmp_path, repo_root, framework, nnodes,
                                                                        api, shape):
    # Execute
    manifests = render_job_file(_job(tmp_path, framework, nnodes), RenderOptions(api=api))

    # Assert
    (job,) = [m for m in manifests if m["kind"] in CRD_FILES]
    jsonschema.validate(job, crd_schema(job["kind"]))
    if job["kind"] == "TrainJob":
        command = job["spec"]["trainer"]["command"]
        assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
        assert job["spec"]["trainer"]["numNodes"] == 3 and job["spec"]["trainer"]["numProcPerNode"] == 2
        reserved = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
        assert not reserved & {e["name"] for e in job["spec"]["trainer"]["env"]}  # the webhook rejects these
    else:
        (replicas,) = [v for k, v in job["spec"].items() if k.endswith("ReplicaSpecs")]
        command = next(iter(replicas.values()))["template"]["spec"]["containers"][0]["command"]
    params = _launch_params(command, INJECTED[shape], repo_root)
    assert params["framework"] == framework and params["nnodes"] == nnodes
    assert params["max_restarts"] == 0  # restarts belong to the operator
    if shape == "paddle":
        assert params["node_rank"] is None  # PaddleJob sets no trainer id: paddle's master assigns ranks
    if shape in ("pytorch-master", "trainjob"):
        assert params["node_rank"] is not None


def test_worker_only_torch_job_is_never_rendered_without_a_rendezvous(tmp_path):
    """A worker-only PyTorchJob gets no MASTER_ADDR: fixed-size jobs carry a Master, elastic ones use PET_RDZV_ENDPOINT."""
    for nnodes in ("1", "2", "2:4"):
        (job,) = [m for m in render_job_file(_job(tmp_path, "torch", nnodes)) if m["kind"] == "PyTorchJob"]
        replicas = job["spec"]["pytorchReplicaSpecs"]
        command = " ".join(next(iter(replicas.values()))["template"]["spec"]["containers"][0]["command"])
        assert ("Master" in replicas) == ("$(MASTER_ADDR)" in command)
        assert "Master" in replicas or "$(PET_RDZV_ENDPOINT)" in command


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_one_restart_mechanism_the_operator(tmp_path, framework):
    for max_restarts, policy in ((0, "Never"), (3, "OnFailure")):
        (job,) = [m for m in render_job_file(_job(tmp_path, framework, max_restarts=max_restarts))
                  if m["kind"] in CRD_FILES]
        (replicas,) = [v for k, v in job["spec"].items() if k.endswith("ReplicaSpecs")]
        assert {r["restartPolicy"] for r in replicas.values()} == {policy}
        assert job["spec"]["runPolicy"]["backoffLimit"] == max_restarts
        command = next(iter(replicas.values()))["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--max-restarts") + 1] == "0"


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_remote_checkpoint_store_is_where_pods_write_checkpoints(tmp_path, api):
    # Execute
    manifests = render_job_file(_job(tmp_path, "torch", checkpoint={"store": "s3://team-ckpt/jobs"}),
                                RenderOptions(api=api))

    # Assert
    (job,) = [m for m in manifests if m["kind"] in CRD_FILES]
    jsonschema.validate(job, crd_schema(job["kind"]))
    if api == "v2":
        command, env = job["spec"]["trainer"]["command"], job["spec"]["trainer"]["env"]
        assert {"name": "AWS_ENDPOINT_URL", "valueFrom": {"secretKeyRef": {
            "name": "ddp-store", "key": "AWS_ENDPOINT_URL", "optional": True}}} in env
    else:
        container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        command = container["command"]
        assert container["envFrom"] == [{"secretRef": {"name": "ddp-store", "optional": True}}]
    assert command[command.index("--ckpt-dir") + 1] == "s3://team-ckpt/jobs/ddp"


def test_local_checkpoint_store_adds_no_ckpt_dir(tmp_path):
    (job,) = [m for m in render_job_file(_job(tmp_path, "paddle")) if m["kind"] == "PaddleJob"]
    assert "--ckpt-dir" not in job["spec"]["paddleReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]


@pytest.mark.parametrize(("framework", "nnodes", "message"), [
    ("paddle", "3", "--api v2: Kubeflow Trainer v2 has no Paddle runtime"),
    ("torch", "2:4", "Kubeflow Trainer v2 has no elastic training"),
])
def test_trainjob_refuses_what_trainer_v2_cannot_run(tmp_path, framework, nnodes, message):
    with pytest.raises(SpecError, match=message):
        render_job_file(_job(tmp_path, framework, nnodes), RenderOptions(api="v2"))


def test_volcano_gang_for_kubeflow_uses_the_operators_scheduling_policy(tmp_path):
    (job,) = [m for m in render_job_file(_job(tmp_path, "torch"), RenderOptions(scheduler="volcano"))
              if m["kind"] == "PyTorchJob"]
    jsonschema.validate(job, crd_schema("PyTorchJob"))
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 3, "queue": "default"}


@pytest.mark.parametrize("example", ["digits-hybrid.yaml", "digits-hybrid-paddle.yaml"])
def test_shipped_examples_render_with_the_image_tag_image_render_prints(tmp_path, repo_root, capsys, example):
    """The documented path: `hfleet image render JOB` prints a tag; `hfleet k8s render JOB -o DIR` uses it."""
    from hybridfleet.cli.app import main

    job = repo_root / "examples" / example
    main(["image", "render", str(job), "--tag-only"])
    tag = capsys.readouterr().out.strip()
    main(["k8s", "render", str(job), "-o", str(tmp_path / "k8s"), "--placeholders"])
    images = {c["image"] for path in (tmp_path / "k8s").glob("*.yaml")
              for m in [yaml.safe_load(path.read_text())] if m["kind"] in ("StatefulSet", "Job")
              for c in m["spec"]["template"]["spec"]["containers"]}
    assert images == {tag}
    main(["k8s", "render", str(job), "-o", str(tmp_path / "k8s2"), "--placeholders", "--image", "r.example/x:1"])
    assert "image: r.example/x:1" in next((tmp_path / "k8s2").glob("*statefulset*")).read_text()
