"""What the rendered pods may do: securityContext and service-account tokens on every pod, NetworkPolicies
whose selectors match the pods they protect, and Secret files that are 0600 from the moment they exist.

Pods are expanded the way the controllers and operators would create them (tests/k8s_pods.py), so a
policy's selector is matched against the labels the real pods carry, operator labels included.
"""

from __future__ import annotations

import copy
import os
import stat
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hybridfleet.k8s.common import RenderOptions
from hybridfleet.k8s.credentials import CredentialSource
from hybridfleet.k8s.render import render_job_file, write_manifests
from k8s_pods import Pod, expand
from tests.kubeflow_schemas import crd_schema

K8S_VERSION = "1.30.0"
PLACEHOLDERS = CredentialSource(placeholders=True)
EXTERNAL = ("ps0.example.org", "ps1.example.org")
PS_JOB = {
    "name": "digits-hybrid", "framework": "torch", "entrypoint": "examples/digits/train_torch.py", "mode": "ps",
    "sites": {"hospital": {"workers": 2, "aggregate": True}, "cloud": {"workers": 2}},
    "ps": {"shards": 2, "snapshot_every_steps": 10},
    "security": {"mutual_tls": True},
    "environment": {"image": "registry.example.com/hfleet/digits:1.0"},
}


def _collective(framework: str, nnodes: str = "2") -> dict:
    return {"name": f"ddp-{framework}", "framework": framework, "mode": "collective",
            "entrypoint": f"examples/collective/train_{framework}.py", "collective": {"nnodes": nnodes},
            "environment": {"image": "registry.example.com/hfleet/ddp:1.0"}}


BUNDLES = {  # name -> (job, options)
    "ps-one-cluster": (PS_JOB, RenderOptions(credentials=PLACEHOLDERS)),
    "ps-volcano": (PS_JOB, RenderOptions(credentials=PLACEHOLDERS, scheduler="volcano")),
    "ps-cloud-site": (PS_JOB, RenderOptions(site="cloud", external_names=EXTERNAL, ingress_cidrs=("198.51.100.0/24",
                                                                                                   "2001:db8::/32"),
                                            credentials=PLACEHOLDERS)),
    "ps-hospital-site": (PS_JOB, RenderOptions(site="hospital", external_names=EXTERNAL, credentials=PLACEHOLDERS)),
    "ps-security-off": ({**PS_JOB, "security": {"tls": "off", "tokens": "off"}}, RenderOptions()),
    "pytorchjob": (_collective("torch"), RenderOptions()),
    "pytorchjob-elastic": (_collective("torch", "1:3"), RenderOptions()),
    "paddlejob": (_collective("paddle"), RenderOptions()),
    "trainjob": (_collective("torch"), RenderOptions(api="v2")),
}


def _render(tmp_path: Path, name: str) -> list[dict]:
    job, options = BUNDLES[name]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return render_job_file(path, options)


def _validate(manifest: dict) -> None:
    if manifest["kind"] == "PodGroup":  # Volcano's CRD: no schema here
        return
    if manifest["apiVersion"].startswith(("kubeflow.org/", "trainer.kubeflow.org/")):
        jsonschema.validate(manifest, crd_schema(manifest["kind"]))
    else:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def _pod_specs(node: Any) -> Iterator[dict]:
    """Every pod spec (a mapping with a ``containers`` list) anywhere in a manifest, TrainJob patches included."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_specs(value)


CONTAINER_CONTEXT = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "privileged": False,
                     "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                     "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
POD_CONTEXT = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
               "seccompProfile": {"type": "RuntimeDefault"}}
WRITABLE = {"/tmp", "/var/lib/hfleet/home", "/var/lib/hfleet/run", "/dev/shm", "/var/lib/hfleet/snapshots"}


@pytest.mark.parametrize("bundle", sorted(BUNDLES))
def test_every_rendered_pod_and_container_runs_non_root_read_only_without_capabilities_or_api_token(tmp_path, bundle):
    # Execute
    manifests = _render(tmp_path, bundle)

    # Assert: every object validates; every pod spec and container carries the whole securityContext
    for manifest in manifests:
        _validate(manifest)
    accounts = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ServiceAccount"}
    specs = [s for m in manifests for s in _pod_specs(m)]
    assert len(specs) == sum(m["kind"] in ("StatefulSet", "Job", "TrainJob") for m in manifests) + sum(
        len(m["spec"].get("pytorchReplicaSpecs", m["spec"].get("paddleReplicaSpecs", {})))
        for m in manifests if m["kind"] in ("PyTorchJob", "PaddleJob"))
    for spec in specs:
        assert spec["securityContext"] == POD_CONTEXT
        if "serviceAccountName" in spec:  # a TrainJob's patch: the account mounts no token
            assert accounts[spec["serviceAccountName"]]["automountServiceAccountToken"] is False
        else:
            assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            assert container["securityContext"] == CONTAINER_CONTEXT
            for mount in container["volumeMounts"]:  # the root is read-only: writable paths are the pod's volumes
                volume = volumes.get(mount["name"], {"claim": mount["name"]})  # else: a StatefulSet's claim
                if "secret" in volume or "configMap" in volume:
                    assert mount["readOnly"] is True
                else:
                    assert mount["mountPath"] in WRITABLE and ("emptyDir" in volume or volume == {"claim": "snapshots"})
        for volume in volumes.values():
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440  # root and the pod's fsGroup only
    for spec in specs:  # HOME and TMPDIR point at the emptyDirs (TrainJob: through trainer.env)
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if env:
                assert env["HOME"] == "/var/lib/hfleet/home" and env["TMPDIR"] == "/tmp"


def _selects(selector: dict[str, Any], pod: Pod) -> bool:
    return all(pod.labels.get(k) == v for k, v in selector["matchLabels"].items())


def _policies(manifests: list[dict]) -> dict[str, dict]:
    return {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "NetworkPolicy"}


def _names(pods: list[Pod], selector: dict[str, Any]) -> list[str]:
    return sorted(p.name for p in pods if _selects(selector, p))


def test_one_cluster_policies_deny_by_default_and_admit_workers_to_shards_and_a_site_to_its_own_hub(tmp_path):
    # Execute
    manifests = _render(tmp_path, "ps-one-cluster")
    pods = expand(manifests).pods

    # Assert: each selector matches exactly the pods it is meant for
    policies = _policies(manifests)
    assert sorted(policies) == ["digits-hybrid-default-deny", "digits-hybrid-metrics", "digits-hybrid-ps",
                                "digits-hybrid-worker-hospital-hub"]
    deny = policies["digits-hybrid-default-deny"]
    assert deny["policyTypes"] == ["Ingress"] and deny["ingress"] == []
    assert _names(pods, deny["podSelector"]) == sorted(p.name for p in pods)
    shards = policies["digits-hybrid-ps"]
    assert _names(pods, shards["podSelector"]) == ["digits-hybrid-ps-0", "digits-hybrid-ps-1"]
    (rule,) = shards["ingress"]
    (source,) = rule["from"]
    assert _names(pods, source["podSelector"]) == ["digits-hybrid-worker-cloud-0-0", "digits-hybrid-worker-cloud-1-0",
                                                   "digits-hybrid-worker-hospital-0-0",
                                                   "digits-hybrid-worker-hospital-1-0"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": 50052}]
    hub = policies["digits-hybrid-worker-hospital-hub"]
    assert _names(pods, hub["podSelector"]) == ["digits-hybrid-worker-hospital-0-0"]  # the leader serves the hub
    (rule,) = hub["ingress"]
    assert _names(pods, rule["from"][0]["podSelector"]) == ["digits-hybrid-worker-hospital-0-0",
                                                            "digits-hybrid-worker-hospital-1-0"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 50060}]
    metrics = policies["digits-hybrid-metrics"]
    assert _names(pods, metrics["podSelector"]) == sorted(p.name for p in pods)
    assert metrics["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"protocol": "TCP", "port": 9464}]}]
    # the hub Service's pods are the ones the hub policy protects
    (hub_service,) = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"].endswith("hospital")]
    assert _names(pods, {"matchLabels": hub_service["spec"]["selector"]}) == _names(pods, rule["from"][0]["podSelector"])


def test_the_shard_site_admits_the_other_sites_only_from_the_given_networks(tmp_path):
    # Execute
    cloud = _render(tmp_path, "ps-cloud-site")
    hospital = _render(tmp_path, "ps-hospital-site")

    # Assert
    pods = expand(cloud).pods
    shards = _policies(cloud)["digits-hybrid-ps"]
    in_cluster, outside = shards["ingress"]
    assert _names(pods, in_cluster["from"][0]["podSelector"]) == ["digits-hybrid-worker-cloud-0-0",
                                                                  "digits-hybrid-worker-cloud-1-0"]
    assert outside["from"] == [{"ipBlock": {"cidr": "198.51.100.0/24"}}, {"ipBlock": {"cidr": "2001:db8::/32"}}]
    assert outside["ports"] == in_cluster["ports"]
    balancers = [m for m in cloud if m["kind"] == "Service" and m["spec"].get("type") == "LoadBalancer"]
    assert [s["spec"]["externalTrafficPolicy"] for s in balancers] == ["Local", "Local"]  # source address kept
    # the hospital's bundle protects its own pods; it has no shards to admit anyone to
    pods = expand(hospital).pods
    policies = _policies(hospital)
    assert sorted(policies) == ["digits-hybrid-default-deny", "digits-hybrid-metrics",
                                "digits-hybrid-worker-hospital-hub"]
    assert _names(pods, policies["digits-hybrid-default-deny"]["podSelector"]) == [
        "digits-hybrid-worker-hospital-0-0", "digits-hybrid-worker-hospital-1-0"]


@pytest.mark.parametrize("bundle", ["pytorchjob", "pytorchjob-elastic", "paddlejob", "trainjob"])
def test_collective_pods_admit_their_own_job_and_the_metrics_scrape_only(tmp_path, bundle):
    # Prepare: a TrainJob's pods come from its runtime; a minimal one stands in for torch-distributed
    manifests = _render(tmp_path, bundle)
    runtime = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
               "metadata": {"name": "torch-distributed"},
               "spec": {"template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
                   "spec": {"containers": [{"name": "node"}]}}}}}]}}}}

    # Execute
    pods = expand([*manifests, runtime]).pods

    # Assert
    policies = _policies(manifests)
    (name,) = [m["metadata"]["name"] for m in manifests if m["kind"] in ("PyTorchJob", "PaddleJob", "TrainJob")]
    assert sorted(policies) == [f"{name}-default-deny", f"{name}-metrics", f"{name}-peers"]
    everyone = sorted(p.name for p in pods)
    assert len(everyone) >= 2
    for policy in policies.values():
        assert _names(pods, policy["podSelector"]) == everyone
    (peers,) = policies[f"{name}-peers"]["ingress"]
    assert _names(pods, peers["from"][0]["podSelector"]) == everyone and "ports" not in peers
    for pod in pods:  # the securityContext reached the pods the operator makes
        assert pod.spec["securityContext"] == POD_CONTEXT


def _creation_modes(monkeypatch, directory: Path) -> dict[str, int]:
    """Spy on os.open: the mode each file under ``directory`` had the moment it was created (umask 0)."""
    modes: dict[str, int] = {}
    real_open = os.open

    def spying_open(path, flags, mode=0o777, *args, **kwargs):
        fd = real_open(path, flags, mode, *args, **kwargs)
        if flags & os.O_CREAT and str(path).startswith(str(directory)):
            modes[Path(path).name] = stat.S_IMODE(os.fstat(fd).st_mode)
        return fd

    monkeypatch.setattr(os, "open", spying_open)
    old = os.umask(0)
    monkeypatch.setattr(os, "umask", lambda mask: old)  # nothing in the code path may tighten it back
    return modes


def test_secret_manifests_are_0600_from_creation_even_under_umask_0(tmp_path, monkeypatch):
    # Prepare
    manifests = _render(tmp_path, "ps-one-cluster")
    out = tmp_path / "out"
    out.mkdir()
    modes = _creation_modes(monkeypatch, out)
    try:
        # Execute
        paths = write_manifests(manifests, out)
    finally:
        os.umask(0o022)

    # Assert: every Secret's file was 0600 when created (a temporary name, renamed into place) and is 0600 now
    secrets = [p for p in paths if "-secret-" in p.name]
    assert len(secrets) == 5
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        created = [mode for name, mode in modes.items() if name.startswith(f".{path.name}.")]
        assert created == [0o600], (path.name, modes)


def test_keys_and_tokens_of_a_pki_and_a_plain_host_bundle_are_0600_from_creation(tmp_path, monkeypatch):
    from hybridfleet.k8s.hostbundle import write_host_bundle
    from hybridfleet.security.certs import make_dev_pki
    from hybridfleet.security.tokens import generate_signing_key

    # Prepare
    pki = tmp_path / "pki"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(PS_JOB))
    modes = _creation_modes(monkeypatch, tmp_path)
    try:
        # Execute
        make_dev_pki(pki, hosts=list(EXTERNAL), clients=["hospital", "cloud"])
        generate_signing_key(pki)
        write_host_bundle(job, RenderOptions(site="hospital", external_names=EXTERNAL,
                                             credentials=CredentialSource(pki)), tmp_path / "bundle")
    finally:
        os.umask(0o022)

    # Assert: no key or token was ever readable by others, not even as a temporary file
    secret = [p for p in [*pki.iterdir(), *(tmp_path / "bundle" / "certs").iterdir()]
              if p.name.endswith(".key") or p.name.startswith("worker-token-")]
    assert {p.name for p in secret} >= {"ca.key", "server.key", "token-signing.key", "client-hospital.key",
                                        "worker-token-hospital-0", "worker-token-hospital-1"}
    for path in secret:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        created = [mode for name, mode in modes.items() if name.startswith(f".{path.name}.")]
        assert created and set(created) == {0o600}, (path.name, modes)


def test_a_run_s_keys_and_worker_tokens_are_0600_from_creation_even_under_umask_0(tmp_path, monkeypatch):
    from hybridfleet.launch.psjob import prepare_security
    from hybridfleet.spec.load import parse_spec

    # Prepare
    spec = parse_spec(copy.deepcopy(PS_JOB), "job.yaml")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    modes = _creation_modes(monkeypatch, tmp_path)
    try:
        # Execute: what `hfleet run` does before it starts the shards (and again at each renewal)
        layout = prepare_security(spec, run_dir)
    finally:
        os.umask(0o022)

    # Assert
    tokens = sorted(p.name for p in (run_dir / "credentials").iterdir())
    assert tokens == ["cloud-0.token", "cloud-1.token", "hospital-0.token", "hospital-1.token"]
    assert stat.S_IMODE((run_dir / "credentials").stat().st_mode) == 0o700
    secret = [*(run_dir / "credentials").iterdir(), *layout.certs_dir.glob("*.key")]
    for path in secret:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        created = [mode for name, mode in modes.items() if name.startswith(f".{path.name}.")]
        assert created and set(created) == {0o600}, (path.name, modes)
