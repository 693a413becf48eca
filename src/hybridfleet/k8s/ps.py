"""Parameter-server jobs as core Kubernetes objects.

Shards: a StatefulSet behind a headless Service, so shard ``i`` is reachable at a stable
``<job>-ps-<i>.<job>-ps:50051`` (gRPC) and ``:50052`` (bulk data plane, unless the job sets
``ps.transport: grpc``). Workers: one Indexed Job per site, the completion index
being the worker's rank. Tokens and certificates come from Secrets rendered as
placeholders: real key material is never written into manifests.
"""

from __future__ import annotations

from hybridfleet.k8s.common import CERTS_DIR, JOB_FILE, PS_BULK_PORT, PS_PORT, Manifest, container, dns_name, labels, metadata, volumes
from hybridfleet.spec.models import JobSpec

TOKEN_PLACEHOLDER = "REPLACE-with-a-token-from-hfleet-certs"
# Written above each Secret file; Kubernetes ignores comments.
SECRET_HOWTO = {
    "certs": ("Fill before applying: `hfleet certs init certs/` then\n"
              "kubectl create secret generic {name} {from_files} --dry-run=client -o yaml | kubectl apply -f -"),
    "tokens": ("Fill before applying: one signed token per role from `hfleet certs` (keys: ps, worker-<site>), e.g.\n"
               "kubectl create secret generic {name} --from-literal=ps=... --from-literal=worker-<site>=... "
               "--dry-run=client -o yaml | kubectl apply -f -"),
}


def shard_service_name(spec: JobSpec) -> str:
    return dns_name(spec.name, "ps")


def server_addresses(spec: JobSpec) -> list[str]:
    """The stable ``host:port`` of every shard, in shard order."""
    svc = shard_service_name(spec)
    return [f"{svc}-{i}.{svc}:{PS_PORT}" for i in range(spec.ps.shards)]


def _tls(spec: JobSpec) -> bool:
    return spec.security.tls != "off"


def _tokens(spec: JobSpec) -> bool:
    return spec.security.tokens != "off"


def _token_env(spec: JobSpec, key: str) -> list[dict]:
    if not _tokens(spec):
        return []
    ref = {"name": dns_name(spec.name, "tokens"), "key": key}
    return [{"name": "HFLEET_TOKEN", "valueFrom": {"secretKeyRef": ref}}]


def cert_files(spec: JobSpec) -> list[str]:
    """The files `--certs` reads (security.load_pki and the token verifier), so the mounted Secret holds them."""
    from hybridfleet.security.certs import CA_CERT, CLIENT_PREFIX, SERVER_CERT, SERVER_KEY
    from hybridfleet.security.tokens import VERIFY_KEY

    files = [CA_CERT, SERVER_CERT, SERVER_KEY]
    if _tokens(spec):
        files.append(VERIFY_KEY)
    if spec.security.mutual_tls:
        files += [f"{CLIENT_PREFIX}worker.pem", f"{CLIENT_PREFIX}worker.key"]
    return files


def secrets(spec: JobSpec) -> list[Manifest]:
    """Placeholder Secrets for the TLS files and the per-role tokens (as the job asks for them)."""
    out = []
    if _tls(spec):
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": metadata(spec, dns_name(spec.name, "certs"), "certs"),
                    "stringData": {f: f"REPLACE-with-{f}-from-hfleet-certs-init" for f in cert_files(spec)}})
    if _tokens(spec):
        keys = ["ps", *(f"worker-{site}" for site in spec.sites)]
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": metadata(spec, dns_name(spec.name, "tokens"), "tokens"),
                    "stringData": {key: TOKEN_PLACEHOLDER for key in keys}})
    return out


def shard_manifests(spec: JobSpec, image: str) -> list[Manifest]:
    """The headless Service and the StatefulSet of ``ps.shards`` shards."""
    name = shard_service_name(spec)
    selector = labels(spec, "ps")
    vols, mounts = volumes(spec, certs=_tls(spec))
    command = ["hfleet", "ps", "serve", JOB_FILE, "--shard", "$(HFLEET_SHARD)", "--host", "0.0.0.0",
               "--port", str(PS_PORT)]
    ports = [{"name": "grpc", "containerPort": PS_PORT, "protocol": "TCP"}]
    if spec.ps.transport != "grpc":
        command += ["--bulk-port", str(PS_BULK_PORT)]
        ports.append({"name": "bulk", "containerPort": PS_BULK_PORT, "protocol": "TCP"})
    if _tls(spec):
        command += ["--certs", CERTS_DIR]
    env = [{"name": "HFLEET_SHARD",  # the StatefulSet ordinal (Kubernetes >= 1.28 pod-index label)
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
           *_token_env(spec, "ps")]
    shard = container(spec, image, "ps", command, mounts, env=env, ports=ports)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, name, "ps"),
               "spec": {"clusterIP": "None", "selector": selector,
                        "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"]}
                                  for p in ports]}}
    stateful_set = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(spec, name, "ps"),
                    "spec": {"serviceName": name, "replicas": spec.ps.shards, "podManagementPolicy": "Parallel",
                             "selector": {"matchLabels": selector},
                             "template": {"metadata": {"labels": selector},
                                          "spec": {"containers": [shard], "volumes": vols}}}}
    return [service, stateful_set]


def worker_jobs(spec: JobSpec, image: str) -> list[Manifest]:
    """One Indexed Job per site: completion index = the worker's rank within the site."""
    servers = ",".join(server_addresses(spec))
    vols, mounts = volumes(spec, certs=_tls(spec))
    jobs = []
    for site, site_spec in spec.sites.items():
        command = ["hfleet", "worker", JOB_FILE, "--site", site, "--site-rank", "$(JOB_COMPLETION_INDEX)",
                   "--servers", servers]
        if _tls(spec):
            command += ["--certs", CERTS_DIR]
        env = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                   "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
               *_token_env(spec, f"worker-{site}")]
        pod_labels = labels(spec, "worker", **{"hybridfleet/site": dns_name(site)})
        worker = container(spec, image, "worker", command, mounts, env=env)
        jobs.append({"apiVersion": "batch/v1", "kind": "Job",
                     "metadata": {"name": dns_name(spec.name, "worker", site), "labels": pod_labels},
                     "spec": {"completionMode": "Indexed", "completions": site_spec.workers,
                              "parallelism": site_spec.workers, "backoffLimit": spec.max_restarts,
                              "template": {"metadata": {"labels": pod_labels},
                                           "spec": {"restartPolicy": "Never", "containers": [worker],
                                                    "volumes": vols}}}})
    return jobs


def render_ps(spec: JobSpec, image: str) -> list[Manifest]:
    """Secrets, shard Service + StatefulSet, and the per-site worker Jobs."""
    return [*secrets(spec), *shard_manifests(spec, image), *worker_jobs(spec, image)]
