"""`hfleet k8s render` output run pod by pod (tests/k8s_kubelet.py): PS jobs in every security setting,
collective PyTorchJob/PaddleJob with two pods, and the two sites of a hybrid job as two clusters joined
by a 20 Mbit/s link.

Credentials come the way docs/DEPLOY.md tells a user to make them: `hfleet certs init` with the names the
shards are dialled at and one client certificate per site, then `hfleet k8s render --certs DIR`, which
writes each site's Secret from those files (and signs its token).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from k8s_kubelet import Cluster, Kubelet, summary
from k8s_pods import HarnessError, load_manifests
from netlab import unavailable_reason
from tests.needs import skip_outside_ci

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, skip_outside_ci(unavailable_reason() and f"network namespaces: {unavailable_reason()}")]
TIMEOUT_S = 150  # a hang guard for a loaded machine, not a speed claim
IMAGE = "registry.example.com/hybridfleet/digits:0.1"
HOSPITAL_NET = ("--ingress-cidr", "10.0.0.0/8")  # the shards' NetworkPolicy (not enforced here) admits the hospital
EXTERNAL = ("ps0.example.org", "ps1.example.org")  # the cloud's shards as another cluster or a plain host dials them
# Training is deterministic without a restart: both frameworks' test accuracy after 250 rounds (torch 0.964,
# paddle 0.969) is what they reach after 400.
PS_STEPS = 250


def _hfleet(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "hybridfleet", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, f"hfleet {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def _workspace(tmp_path: Path) -> Path:
    """What the image's WORKDIR holds: the examples (the job's entrypoint is relative to it)."""
    workspace = tmp_path / "workspace"
    for sub in ("digits", "collective"):
        shutil.copytree(REPO / "examples" / sub, workspace / "examples" / sub,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return workspace


def _render(tmp_path: Path, job: dict, *options: str, out: str = "k8s") -> list[dict]:
    """`hfleet k8s render JOB OPTIONS -o OUT` of ``job``; returns the objects it wrote."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    _hfleet("k8s", "render", str(path), *options, "-o", str(tmp_path / out), cwd=tmp_path)
    return load_manifests(tmp_path / out)


def _dialled_names(manifests: list[dict]) -> list[str]:
    """The names a StatefulSet's pods are dialled at in the cluster: ``<pod>.<service>`` and longer forms."""
    names = []
    for obj in manifests:
        if obj["kind"] == "StatefulSet":
            svc, ns = obj["spec"]["serviceName"], obj["metadata"].get("namespace", "default")
            for i in range(obj["spec"].get("replicas", 1)):
                base = f"{obj['metadata']['name']}-{i}.{svc}"
                names += [base, f"{base}.{ns}.svc", f"{base}.{ns}.svc.cluster.local"]
    return names


def make_certs(tmp_path: Path, job: dict, external: tuple[str, ...] = ()) -> Path:
    """The user's first step: certificates for the names the shards are dialled at (learnt from a draft
    render with placeholders, plus ``external``), one client certificate per site."""
    draft = _render(tmp_path, job, "--placeholders", out="draft")
    hosts = [a for name in [*_dialled_names(draft), *external] for a in ("--host", name)]
    clients = [a for site in job.get("sites", {}) for a in ("--client", site)]
    _hfleet("certs", "init", str(tmp_path / "k8s-certs"), *hosts, *clients, cwd=tmp_path)
    return tmp_path / "k8s-certs"


def _ps_job(framework: str, **security) -> dict:
    job = yaml.safe_load((REPO / "examples" / "digits-deploy.yaml").read_text())
    job["framework"] = framework
    job["entrypoint"] = f"examples/digits/train_{framework}.py"
    job["security"] = {**job.get("security", {}), **security}
    job["train"] = {**job["train"], "steps": PS_STEPS}
    return job


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """`make_certs` for the deploy example: its dialled names and sites are the same in either framework and
    in every security setting, so one set serves every test of the single-cluster job."""
    return make_certs(tmp_path_factory.mktemp("certs"), _ps_job("torch"))


@pytest.fixture(scope="module")
def external_certs(tmp_path_factory) -> Path:
    """`make_certs` for the deploy example with its shards also dialled at the ``EXTERNAL`` names."""
    return make_certs(tmp_path_factory.mktemp("external-certs"), _ps_job("torch"), EXTERNAL)


def _final_metrics(text: str) -> list[dict]:
    return [r for r in (json.loads(line) for line in text.splitlines() if line.startswith("{"))
            if r.get("event") == "metrics" and r.get("final")]


def _assert_ps_trained(runs: dict) -> None:
    workers = {k: r for k, r in runs.items() if r.pod.owner.startswith("Job/")}
    assert len(workers) == 2, summary(runs)
    for key, run in workers.items():
        assert run.returncodes == {"worker": 0}, summary(runs)
        finals = _final_metrics(run.log())
        assert len(finals) == 1 and finals[0]["test_accuracy"] >= 0.95, (key, finals)
        own = f"worker-token-{run.pod.labels['hybridfleet/site']}-{run.pod.labels['hybridfleet/site-rank']}"
        if "certs" in run.volumes:  # what the pod had in /etc/hfleet/certs: no other worker's token
            assert {p.name for p in Path(run.volumes["certs"][1]).iterdir() if p.name.startswith("worker-token-")} \
                <= {own}, key
    shards = [r for r in runs.values() if r.pod.owner.startswith("StatefulSet/")]
    assert len(shards) == 2 and all('"shard_serving"' in r.log() for r in shards), summary(runs)


# Every security setting trains pod by pod: TLS and tokens (the default) in
# test_a_sigkilled_shard_pod_is_restarted_and_resumes_from_its_volume and the plain-host test, tokens without
# TLS in test_an_aggregating_site_s_followers_reach_their_leader_by_its_pod_name, mutual TLS in
# test_hospital_and_cloud_as_two_clusters_over_a_20_mbit_link, TLS without tokens and neither here.
@pytest.mark.parametrize("framework,security", [
    ("torch", {"tokens": "off"}), ("torch", {"tls": "off", "tokens": "off"}),
], ids=["torch-tokens-off", "torch-all-off"])
def test_rendered_ps_job_trains_pod_by_pod(tmp_path, framework, security, certs):
    # Prepare: render with the Secrets a user would create
    job = _ps_job(framework, **security)
    manifests = _render(tmp_path, job, "--certs", str(certs))
    # Execute
    with Kubelet([Cluster("cloud", manifests)], _workspace(tmp_path), tmp_path / "pods") as kubelet:
        kubelet.start()
        runs = kubelet.wait(TIMEOUT_S)
    # Assert
    _assert_ps_trained(runs)
    shard = runs["cloud/digits-deploy-ps-0"]
    assert shard.pod.hostname == "digits-deploy-ps-0" and shard.pod.subdomain == "digits-deploy-ps"


@pytest.mark.parametrize("framework,security", [("paddle", {"tls": "off"})], ids=["paddle-tls-off"])
def test_an_aggregating_site_s_followers_reach_their_leader_by_its_pod_name(tmp_path, framework, security):
    # Prepare: the hospital's two workers reduce inside the site; each is its own Job with its own Secret
    job = _ps_job(framework, **security)
    job["sites"]["hospital"] = {**job["sites"]["hospital"], "workers": 2, "aggregate": True}
    manifests = _render(tmp_path, job, "--certs", str(make_certs(tmp_path, job)))
    # Execute
    with Kubelet([Cluster("cloud", manifests)], _workspace(tmp_path), tmp_path / "pods") as kubelet:
        kubelet.start()
        runs = kubelet.wait(TIMEOUT_S)
    # Assert: all three workers finished with the joint model; the follower dialled the leader's pod name
    workers = {k: r for k, r in runs.items() if r.pod.owner.startswith("Job/")}
    assert sorted(workers) == ["cloud/digits-deploy-worker-cloud-0-0", "cloud/digits-deploy-worker-hospital-0-0",
                               "cloud/digits-deploy-worker-hospital-1-0"], summary(runs)
    for key, run in workers.items():
        assert run.returncodes == {"worker": 0}, summary(runs)
        finals = _final_metrics(run.log())
        assert len(finals) == 1 and finals[0]["test_accuracy"] >= 0.9, (key, finals)
    follower = runs["cloud/digits-deploy-worker-hospital-1-0"].pod
    assert {"name": "HFLEET_SITE_HUB", "value": "digits-deploy-worker-hospital-0.digits-deploy-worker-hospital:50060"} \
        in follower.spec["containers"][0]["env"]


@pytest.mark.parametrize("framework", ["torch"])
def test_a_sigkilled_shard_pod_is_restarted_and_resumes_from_its_volume(tmp_path, framework, certs):
    from hybridfleet.ckpt import list_checkpoints

    # Prepare
    job = _ps_job(framework)
    manifests = _render(tmp_path, job, "--certs", str(certs))
    # Execute: SIGKILL shard 0's container once its volume holds the round-20 snapshot
    with Kubelet([Cluster("cloud", manifests)], _workspace(tmp_path), tmp_path / "pods") as kubelet:
        kubelet.start()
        shard = kubelet.runs["cloud/digits-deploy-ps-0"]
        snapshots = shard.directory / "volumes"
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and not any(
                c.step >= 20 for d in snapshots.glob("*/ps/shard-0") for c in list_checkpoints(str(d))):
            time.sleep(0.05)
        kubelet.kill("cloud/digits-deploy-ps-0")
        runs = kubelet.wait(TIMEOUT_S)
    # Assert: restarted in place, restored from the volume, the job completed
    _assert_ps_trained(runs)
    assert shard.pod.hostname == "digits-deploy-ps-0" and shard.pod.subdomain == "digits-deploy-ps"
    assert shard.restarts == {"ps": 1}, summary(runs)
    after = shard.log().split("--- restart 1 ---")[1]
    restored = [json.loads(line) for line in after.splitlines() if '"snapshot_restored"' in line]
    assert len(restored) == 1 and restored[0]["version"] >= 20, after[-2000:]


def _collective_job(framework: str) -> dict:
    return {"name": f"digits-{framework}-ddp", "framework": framework,
            "entrypoint": f"examples/collective/train_{framework}.py", "args": ["--epochs", "8"],
            "mode": "collective", "collective": {"nproc_per_node": 1, "nnodes": "2"},
            "resources": {"cpu": 1, "memory": "1Gi", "shm": "256Mi"}, "environment": {"image": IMAGE}}


@pytest.mark.parametrize("framework,api", [("torch", "v1"), ("paddle", "v1"), ("torch", "v2")],
                         ids=["PyTorchJob", "PaddleJob", "torch-TrainJob"])
def test_rendered_collective_job_trains_on_two_pods(tmp_path, framework, api):
    # Prepare
    job = _collective_job(framework)
    manifests = _render(tmp_path, job, "--api", api)
    (training_job,) = [m for m in manifests if m["kind"] in ("PyTorchJob", "PaddleJob", "TrainJob")]
    # Execute
    with Kubelet([Cluster("cloud", manifests)], _workspace(tmp_path), tmp_path / "pods") as kubelet:
        kubelet.start()
        runs = kubelet.wait(TIMEOUT_S)
    # Assert: two pods, named and addressed as the operator does, both exit 0, the model learned
    assert len(runs) == 2, summary(runs)
    assert all(list(r.returncodes.values()) == [0] for r in runs.values()), summary(runs)
    logs = "\n".join(r.log() for r in runs.values())
    finals = [json.loads(m) for m in re.findall(r'\{[^\n]*"final"[^\n]*\}', logs)]
    assert finals and all(f["world_size"] == 2 and f["test_acc"] >= 0.9 for f in finals), logs[-3000:]
    names = sorted(r.pod.name for r in runs.values())
    expected = {"PyTorchJob": ["master-0", "worker-0"], "PaddleJob": ["worker-0", "worker-1"],
                "TrainJob": ["node-0-0", "node-0-1"]}[training_job["kind"]]
    assert training_job["kind"] == {"torch": "PyTorchJob", "paddle": "PaddleJob"}[framework] if api == "v1" \
        else training_job["kind"] == "TrainJob"
    assert names == [f"{job['name']}-{suffix}" for suffix in expected]


@pytest.mark.parametrize("framework,security", [("paddle", {"mutual_tls": True})], ids=["paddle-mutual-tls"])
def test_hospital_and_cloud_as_two_clusters_over_a_20_mbit_link(tmp_path, framework, security, external_certs):
    # Prepare: one bundle per site; the cloud's shards are exposed under external names (LoadBalancer
    # Services), which are all the hospital's bundle knows of them
    job, certs = _ps_job(framework, **security), external_certs
    site_options = [a for name in EXTERNAL for a in ("--external-name", name)]
    cloud = _render(tmp_path, job, "--site", "cloud", *site_options, *HOSPITAL_NET, "--certs", str(certs),
                    out="k8s-cloud")
    hospital = _render(tmp_path, job, "--site", "hospital", *site_options, "--certs", str(certs), out="k8s-hospital")
    # Execute
    with Kubelet([Cluster("cloud", cloud), Cluster("hospital", hospital)], _workspace(tmp_path), tmp_path / "pods",
                 wan_mbit=20) as kubelet:
        kubelet.start()
        runs = kubelet.wait(TIMEOUT_S)
        wan = kubelet.lab.link_counters()
    # Assert: trained across the capped link; the hospital's cluster held only its own credentials
    _assert_ps_trained(runs)
    assert {rate for rate, _ in wan.values()} == {"20Mbit"} and all(sent > 5e6 for _, sent in wan.values()), wan
    assert {k for k in runs if k.startswith("hospital/")} == {"hospital/digits-deploy-worker-hospital-0-0"}
    hospital_run = runs["hospital/digits-deploy-worker-hospital-0-0"]
    assert hospital_run.host.segment == "hospital"
    secrets = kubelet.bundles["hospital"].secrets
    assert all(not ({"server.key", "token-signing.key", "ca.key"} & set(keys)) for keys in secrets.values())


@pytest.mark.parametrize("framework", ["torch"])
def test_hospital_on_plain_hosts_and_the_cloud_in_kubernetes_over_a_20_mbit_link(tmp_path, framework,
                                                                                  external_certs):
    # Prepare: the cloud's bundle as above; the hospital has no Kubernetes, so it gets the plain-host bundle
    # (job file, CA certificate, token, run-worker.sh) next to its copy of the training code
    job, certs = _ps_job(framework), external_certs
    site_options = [a for name in EXTERNAL for a in ("--external-name", name)]
    cloud = _render(tmp_path, job, "--site", "cloud", *site_options, *HOSPITAL_NET, "--certs", str(certs),
                    out="k8s-cloud")
    bundle = tmp_path / "hospital-hosts"
    _hfleet("k8s", "render", str(tmp_path / "job.yaml"), "--site", "hospital", "--plain-host", *site_options,
            "--certs", str(certs), "-o", str(bundle), cwd=tmp_path)
    workspace = _workspace(tmp_path)
    shutil.copytree(workspace / "examples", bundle / "examples")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"),
           "OMP_NUM_THREADS": "1"}
    # Execute
    with Kubelet([Cluster("cloud", cloud), Cluster("hospital", [])], workspace, tmp_path / "pods",
                 wan_mbit=20) as kubelet:
        host = kubelet.plain_host("hospital-0", "hospital")
        kubelet.start()
        with (tmp_path / "hospital-0.log").open("w") as log:
            worker = subprocess.Popen([*host.exec_prefix, "./run-worker.sh", "0"], cwd=bundle, env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
        rc = worker.wait(timeout=TIMEOUT_S)
        runs = kubelet.wait(TIMEOUT_S)
        wan = kubelet.lab.link_counters()
    # Assert
    assert all(sent > 5e6 for _, sent in wan.values()), wan  # the hospital's traffic crossed the capped link
    text = (tmp_path / "hospital-0.log").read_text()
    assert rc == 0, text[-3000:] + summary(runs)
    finals = _final_metrics(text)
    assert len(finals) == 1 and finals[0]["test_accuracy"] >= 0.95, finals
    (cloud_worker,) = [r for r in runs.values() if r.pod.owner.startswith("Job/")]
    assert cloud_worker.returncodes == {"worker": 0}, summary(runs)
    assert _final_metrics(cloud_worker.log())[0]["test_accuracy"] == finals[0]["test_accuracy"]  # one model
    assert sorted(p.name for p in (bundle / "certs").iterdir()) == ["ca.pem", "worker-token-hospital-0"]


PROBE = """
echo "ids: $(id -u) $(id -g) $(id -G)"
echo "certs: $(ls /etc/hfleet/certs | tr '\\n' ' ')"
cat "$HFLEET_TOKEN_FILE" > /dev/null && echo "token: readable"
for path in probe /etc/probe /usr/probe /etc/hfleet/certs/probe /tmp/probe "$HOME/probe" /var/lib/hfleet/run/probe; do
  if touch "$path" 2>/dev/null; then echo "writable: $path"; else echo "refused: $path"; fi
done
"""


def test_a_rendered_worker_pod_holds_only_its_own_token_and_writes_only_its_volumes_as_its_own_user(tmp_path,
                                                                                                     certs):
    # Prepare: the rendered pod of worker hospital-1, its command swapped for a probe of what it may do
    job = _ps_job("torch")
    job["sites"]["hospital"]["workers"] = 2  # worker Jobs only: the shards' dialled names stay those of `certs`
    manifests = _render(tmp_path, job, "--certs", str(certs))
    keep = {"ConfigMap", "Secret"}
    probe = [m for m in manifests if m["kind"] in keep or m["metadata"]["name"] == "digits-deploy-worker-hospital-1"]
    (pod_job,) = [m for m in probe if m["kind"] == "Job"]
    pod_job["spec"]["template"]["spec"]["containers"][0]["command"] = ["sh", "-c", PROBE]
    # Execute
    with Kubelet([Cluster("cloud", probe)], _workspace(tmp_path), tmp_path / "pods") as kubelet:
        kubelet.start()
        runs = kubelet.wait(TIMEOUT_S)
    # Assert
    (run,) = runs.values()
    out = run.log()
    assert run.returncodes == {"worker": 0}, out
    said = [tuple(line.split(": ", 1)) for line in out.splitlines() if ": " in line]
    values = {key: value.split() for key, value in said}
    assert values["ids"] == ["10001", "10001", "10001"], out  # uid, gid, and the groups: fsGroup alone
    assert values["certs"] == ["ca.pem", "worker-token-hospital-1"] and values["token"] == ["readable"], out
    refused = [value for key, value in said if key == "refused"]
    writable = [value for key, value in said if key == "writable"]
    assert refused == ["probe", "/etc/probe", "/usr/probe", "/etc/hfleet/certs/probe"], out
    assert writable == ["/tmp/probe", "/var/lib/hfleet/home/probe", "/var/lib/hfleet/run/probe"], out


def _env_of(pod) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod.operator_env}


def test_operator_env_follows_the_worked_examples_of_operators_md():
    from k8s_pods import expand

    def replica(container: str, count: int) -> dict:
        return {"replicas": count, "template": {"spec": {"containers": [{"name": container, "image": IMAGE}]}}}

    mnist = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "mnist"},
             "spec": {"pytorchReplicaSpecs": {"Master": replica("pytorch", 1), "Worker": replica("pytorch", 2)}}}
    pd = {"apiVersion": "kubeflow.org/v1", "kind": "PaddleJob", "metadata": {"name": "pd"},
          "spec": {"paddleReplicaSpecs": {"Worker": replica("paddle", 2)}}}
    worker_only = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "wo"},
                   "spec": {"pytorchReplicaSpecs": {"worker": replica("pytorch", 2)}}}
    bundle = expand([mnist, pd, worker_only])
    pods = {p.name: p for p in bundle.pods}
    # PyTorchJob mnist: Master x1, Worker x2
    for name, rank in (("mnist-master-0", "0"), ("mnist-worker-0", "1"), ("mnist-worker-1", "2")):
        env = _env_of(pods[name])
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "mnist-master-0"
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == "23456"
        assert (env["WORLD_SIZE"], env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("3", "3", "auto")
        assert env["RANK"] == env["PET_NODE_RANK"] == rank and env["PYTHONUNBUFFERED"] == "1"
    services = {s.name: s for s in bundle.services}
    assert services["mnist-worker-1"].headless and services["mnist-worker-1"].ports == [
        {"name": "pytorchjob-port", "port": 23456}]
    assert services["mnist-worker-1"].selects(pods["mnist-worker-1"]) and not services["mnist-worker-1"].selects(
        pods["mnist-worker-0"])
    # PaddleJob pd: collective, Worker x2; worker 0 hosts the rendezvous on its pod IP
    assert _env_of(pods["pd-worker-0"]) == {
        "PYTHONUNBUFFERED": "1", "PADDLE_JOB_ID": "pd", "PADDLE_NNODES": "2",
        "POD_IP_DUMMY": {"fieldRef": {"fieldPath": "status.podIP"}}, "PADDLE_MASTER": "$(POD_IP_DUMMY):36543"}
    assert _env_of(pods["pd-worker-1"])["PADDLE_MASTER"] == "pd-worker-0:36543"
    assert "PADDLE_TRAINER_ID" not in _env_of(pods["pd-worker-1"])
    # a worker-only PyTorchJob gets no master address, rank or world size
    assert not {"MASTER_ADDR", "RANK", "WORLD_SIZE"} & set(_env_of(pods["wo-worker-0"]))


def test_a_placeholder_secret_is_reported_by_object_and_key_before_anything_runs(tmp_path, certs):
    from k8s_kubelet import _volume_sources, container_env
    from k8s_pods import expand

    job = _ps_job("torch")
    placeholders = expand(_render(tmp_path, job, "--placeholders"))
    worker = next(p for p in placeholders.pods if p.name == "digits-deploy-worker-hospital-0-0")

    class Nowhere:
        address, name = "10.0.0.1", "nowhere"

    with pytest.raises(HarnessError, match=r"^pod digits-deploy-worker-hospital-0-0: Secret '[a-z0-9-]+' key '[a-z.-]+' "
                                           r"still holds the placeholder 'REPLACE"):
        _volume_sources(placeholders, worker, tmp_path / "placeholder-volumes")  # the Secret mounted as files
    real = expand(_render(tmp_path, job, "--certs", str(certs), out="k8s-real"))
    worker = next(p for p in real.pods if p.name == "digits-deploy-worker-hospital-0-0")
    env = container_env(real, worker, Nowhere, worker.spec["containers"][0])
    assert env["HFLEET_TOKEN_FILE"] == "/etc/hfleet/certs/worker-token-hospital-0"
