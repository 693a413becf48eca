"""`hfleet k8s render`: manifests validated offline (kubernetes-validate; Kubeflow CRD schemas)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hybridfleet.cli.app import main
from hybridfleet.errors import SpecError
from hybridfleet.k8s.common import RenderOptions
from hybridfleet.k8s.credentials import CredentialSource
from hybridfleet.k8s.render import render_job_file, write_manifests
from tests.kubeflow_schemas import crd_schema

K8S_VERSION = "1.30.0"
PLACEHOLDERS = RenderOptions(credentials=CredentialSource(placeholders=True))
DIGEST = "sha256:" + "ab" * 32

PS_JOB = {
    "name": "digits-hybrid", "framework": "torch", "entrypoint": "examples/digits/train.py", "mode": "ps",
    "sites": {"hospital_a": {"workers": 2}, "cloud": {"workers": 3}},
    "ps": {"shards": 2},
    "resources": {"cpu": 2, "memory": "4Gi", "gpus": 1, "shm": "2Gi"},
    "environment": {"image": "registry.example.com/hfleet/digits:1.0"},
}


def _collective_job(framework: str, nnodes: str = "3") -> dict:
    return {"name": "digits-ddp", "framework": framework, "entrypoint": f"examples/collective/train_{framework}.py",
            "args": ["--epochs", "5"], "mode": "collective",
            "collective": {"nproc_per_node": 2, "nnodes": nnodes},
            "resources": {"cpu": 0.5, "memory": "1Gi", "shm": "512Mi"},
            "environment": {"image": "registry.example.com/hfleet/ddp:2.0"}}


def _write_job(tmp_path: Path, job: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _validate(manifest: dict) -> None:
    if manifest["apiVersion"].startswith(("kubeflow.org/", "trainer.kubeflow.org/")):
        jsonschema.validate(manifest, crd_schema(manifest["kind"]))
    else:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def _by_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def test_ps_job_renders_valid_core_objects_with_commands_resources_and_secrets(tmp_path):
    # Prepare
    job = _write_job(tmp_path, PS_JOB)

    # Execute
    manifests = render_job_file(job, PLACEHOLDERS)

    # Assert
    for manifest in manifests:
        _validate(manifest)
    kinds = [m["kind"] for m in manifests]
    assert kinds.count("Job") == 5 and kinds.count("StatefulSet") == 1 and kinds.count("Service") == 1
    assert kinds.count("Secret") == 6 and kinds.count("ConfigMap") == 1  # the shards' and one per worker
    (service,) = _by_kind(manifests, "Service")
    assert service["spec"]["clusterIP"] == "None"
    (shards,) = _by_kind(manifests, "StatefulSet")
    assert shards["spec"]["replicas"] == 2
    shard = shards["spec"]["template"]["spec"]["containers"][0]
    assert shard["command"] == ["hfleet", "ps", "serve", "/etc/hfleet/job/job.yaml", "--shard", "$(HFLEET_SHARD)",
                                "--host", "0.0.0.0", "--port", "50051", "--expected-workers", "5",
                                "--bulk-port", "50052", "--certs", "/etc/hfleet/certs"]
    assert [p["port"] for p in service["spec"]["ports"]] == [50051, 50052]
    assert [p["containerPort"] for p in shard["ports"]] == [50051, 50052]
    # shards aggregate on the CPU: resources.gpus is for the workers only
    assert shard["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
    jobs = {j["metadata"]["name"]: j for j in _by_kind(manifests, "Job")}
    assert sorted(jobs) == ["digits-hybrid-worker-cloud-0", "digits-hybrid-worker-cloud-1",
                            "digits-hybrid-worker-cloud-2", "digits-hybrid-worker-hospital-a-0",
                            "digits-hybrid-worker-hospital-a-1"]  # one Job (one pod) per worker
    hospital = jobs["digits-hybrid-worker-hospital-a-1"]
    assert hospital["spec"]["completions"] == 1 and "completionMode" not in hospital["spec"]
    worker = hospital["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"] == [
        "hfleet", "worker", "/etc/hfleet/job/job.yaml", "--site", "hospital_a", "--site-rank", "1",
        "--servers", "digits-hybrid-ps-0.digits-hybrid-ps:50051,digits-hybrid-ps-1.digits-hybrid-ps:50051",
        "--certs", "/etc/hfleet/certs"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    token = [e for e in worker["env"] if e["name"] == "HFLEET_TOKEN_FILE"][0]  # each pod: its own worker's token
    assert token["value"] == "/etc/hfleet/certs/worker-token-hospital_a-1"
    volumes = {v["name"]: v for v in hospital["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    (config,) = _by_kind(manifests, "ConfigMap")
    assert yaml.safe_load(config["data"]["job.yaml"]) == PS_JOB


def test_ps_job_on_grpc_only_renders_no_bulk_port(tmp_path):
    # Prepare
    job = _write_job(tmp_path, {**PS_JOB, "ps": {**PS_JOB["ps"], "transport": "grpc"}})

    # Execute
    manifests = render_job_file(job, PLACEHOLDERS)

    # Assert
    for manifest in manifests:
        _validate(manifest)
    (service,) = _by_kind(manifests, "Service")
    (shards,) = _by_kind(manifests, "StatefulSet")
    shard = shards["spec"]["template"]["spec"]["containers"][0]
    assert "--bulk-port" not in shard["command"]
    assert [p["port"] for p in service["spec"]["ports"]] == [50051]


def test_placeholder_secrets_only_when_asked_and_with_a_comment_naming_the_certs_command(tmp_path):
    # Execute
    paths = write_manifests(render_job_file(_write_job(tmp_path, PS_JOB), PLACEHOLDERS), tmp_path / "out",
                            howto="Placeholders: see `hfleet certs init certs/ --host x`")

    # Assert
    secret_files = [p for p in paths if "-secret-" in p.name]
    assert len(secret_files) == 6  # the shards' and one per worker
    for path in secret_files:
        text = path.read_text()
        assert text.startswith("# Placeholders:")
        assert "BEGIN" not in text  # no PEM material
        assert all(v.startswith("REPLACE-") for v in yaml.safe_load(text)["stringData"].values())
        assert path.stat().st_mode & 0o077 == 0


def test_cli_without_certs_or_placeholders_refuses_and_writes_nothing(tmp_path, capsys):
    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["k8s", "render", str(_write_job(tmp_path, PS_JOB)), "-o", str(tmp_path / "out")])

    # Assert
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pass --certs DIR" in err and "--placeholders" in err and "Traceback" not in err
    assert "hint: pass --certs DIR" in err and "fix the job file" not in err  # nothing is wrong with the job file
    assert not (tmp_path / "out").exists()


def test_cli_placeholder_secret_comment_gives_the_certs_init_command_with_the_service_names(tmp_path, capsys):
    main(["k8s", "render", str(_write_job(tmp_path, PS_JOB)), "-o", str(tmp_path / "out"), "--placeholders"])
    text = next((tmp_path / "out").glob("*-secret-*-creds-ps.yaml")).read_text()
    assert ("hfleet certs init certs/ --host digits-hybrid-ps-0.digits-hybrid-ps "
            "--host digits-hybrid-ps-1.digits-hybrid-ps") in text


@pytest.mark.parametrize(("framework", "kind", "replica_key"),
                         [("torch", "PyTorchJob", "pytorchReplicaSpecs"), ("paddle", "PaddleJob", "paddleReplicaSpecs")])
def test_collective_job_renders_a_valid_kubeflow_job(tmp_path, framework, kind, replica_key):
    # Execute
    manifests = render_job_file(_write_job(tmp_path, _collective_job(framework)))

    # Assert
    for manifest in manifests:
        _validate(manifest)
    (job,) = _by_kind(manifests, kind)
    replicas = job["spec"][replica_key]
    assert sum(r["replicas"] for r in replicas.values()) == 3
    main_container = next(iter(replicas.values()))["template"]["spec"]["containers"][0]
    assert main_container["name"] == {"torch": "pytorch", "paddle": "paddle"}[framework]
    assert main_container["command"][:4] == ["hfleet", "launch", "--framework", framework]
    assert main_container["command"][-3:] == [f"examples/collective/train_{framework}.py", "--epochs", "5"]
    assert main_container["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}


def test_elastic_torch_job_carries_an_elastic_policy(tmp_path):
    manifests = render_job_file(_write_job(tmp_path, _collective_job("torch", nnodes="2:4")))
    (job,) = _by_kind(manifests, "PyTorchJob")
    _validate(job)
    assert job["spec"]["elasticPolicy"]["minReplicas"] == 2
    assert job["spec"]["elasticPolicy"]["maxReplicas"] == 4
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]  # the operator's webhook wants Worker for elastic


def test_image_is_pinned_by_the_digest_in_the_lock(tmp_path):
    # Prepare
    (tmp_path / "hfleet.lock.json").write_text(json.dumps({"image_digest": DIGEST}))
    job = {**PS_JOB, "environment": {"image": "registry.example.com:5000/hfleet/digits:1.0", "lock": "hfleet.lock.json"}}

    # Execute
    manifests = render_job_file(_write_job(tmp_path, job), PLACEHOLDERS)

    # Assert
    images = {c["image"] for m in manifests if m["kind"] in ("Job", "StatefulSet")
              for c in m["spec"]["template"]["spec"]["containers"]}
    assert images == {f"registry.example.com:5000/hfleet/digits@{DIGEST}"}


def test_image_without_digest_stays_as_named(tmp_path):
    manifests = render_job_file(_write_job(tmp_path, PS_JOB), PLACEHOLDERS)
    (shards,) = _by_kind(manifests, "StatefulSet")
    assert shards["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/hfleet/digits:1.0"


@pytest.mark.parametrize(("environment", "lock", "message"), [
    ({"image": "r/x:1", "lock": "missing.json"}, None, "environment.lock: no such file"),
    ({"image": "r/x:1", "lock": "l.json"}, {"image_digest": "sha256:zz"}, "image_digest must be sha256:<64 hex>"),
])
def test_bad_image_settings_are_errors_naming_the_field_and_write_nothing(tmp_path, capsys, environment, lock, message):
    # Prepare
    if lock is not None:
        (tmp_path / "l.json").write_text(json.dumps(lock))
    job = _write_job(tmp_path, {**PS_JOB, "environment": environment})

    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["k8s", "render", str(job), "-o", str(tmp_path / "out"), "--placeholders"])

    # Assert
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_invalid_job_file_is_a_spec_error_naming_the_field(tmp_path):
    job = _write_job(tmp_path, {**PS_JOB, "sites": {"cloud": {"workers": 0}}})
    with pytest.raises(SpecError, match="sites.cloud.workers"):
        render_job_file(job)


def test_cli_writes_one_file_per_object_and_lists_them(tmp_path, capsys):
    # Execute
    main(["k8s", "render", str(_write_job(tmp_path, PS_JOB)), "-o", str(tmp_path / "out"), "--placeholders"])

    # Assert
    written = sorted(str(p) for p in (tmp_path / "out").glob("*.yaml"))
    assert capsys.readouterr().out.split() == written
    # ConfigMap, 6 Secrets (shards + 5 workers), Service, StatefulSet, 5 Jobs, 3 NetworkPolicies
    assert len(written) == 17
    for path in written:
        _validate(yaml.safe_load(Path(path).read_text()))


def test_schema_check_rejects_a_malformed_kubeflow_job(tmp_path):
    # Prepare: the rendered job with a field of the wrong type
    (job,) = _by_kind(render_job_file(_write_job(tmp_path, _collective_job("torch"))), "PyTorchJob")
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"

    # Execute / Assert
    with pytest.raises(jsonschema.ValidationError, match="'one' is not of type 'integer'"):
        _validate(job)


def test_every_rendered_pod_template_is_annotated_for_prometheus_and_serves_metrics(tmp_path):
    # Prepare
    from hybridfleet.k8s.render import render_job_file
    from hybridfleet.k8s.scrape import METRICS_PORT, _pod_templates

    manifests = render_job_file(_write_job(tmp_path, PS_JOB), PLACEHOLDERS) + render_job_file(
        _write_job(tmp_path, _collective_job("torch")))
    # Execute
    templates = [t for m in manifests for t in _pod_templates(m)]
    # Assert
    assert templates
    for t in templates:
        assert t["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert t["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
        assert t["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
        for c in t["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HFLEET_METRICS_PORT"] == str(METRICS_PORT) and env["HFLEET_METRICS_HOST"] == "0.0.0.0"
