"""Parameter-server jobs as core Kubernetes objects, for one cluster or one site of the hybrid topology.

Shards: a StatefulSet behind a headless Service, so shard ``i`` is reachable inside the
cluster at ``<job>-ps-<i>.<job>-ps:50051`` (gRPC) and ``:50052`` (bulk data plane, unless
the job sets ``ps.transport: grpc``). With external names (``--external-name``, one per
shard) every shard also gets a LoadBalancer Service exposing both ports under the same
numbers, because a worker reaches a shard's bulk plane at the gRPC host and the port the
shard announces (so not a NodePort, whose numbers differ from the pod's); they keep the
client's source address (``externalTrafficPolicy: Local``), which the shards' NetworkPolicy
checks (`hybridfleet.k8s.netpol`).

Workers: one Job per worker, each mounting a Secret that holds that worker's token alone
(`credentials`). A Secret is mounted whole and a pod template cannot pick a volume by its
index, so an Indexed Job would have to give every pod every token of its site, and any pod
could then act as any worker of the site.

Restarts: a shard pod is restarted by its StatefulSet (``restartPolicy: Always``) and
resumes from its newest snapshot, kept in a remote ``checkpoint.store`` or else on the
shard's own PersistentVolumeClaim; a worker pod by its Job (``backoffLimit:
max_restarts``); no process restarts itself inside a pod.
"""

from __future__ import annotations

from typing import Any

from hybridfleet.k8s.common import (
    CERTS_DIR, JOB_FILE, PS_BULK_PORT, PS_PORT, Manifest, RenderOptions, container, dns_name, harden_pod, labels,
    metadata, volumes,
)
from hybridfleet.k8s.credentials import (
    SHARD_ROLE, check_server_names, credential_secret, secret_name, tls_on, tokens_on, token_file,
)
from hybridfleet.security.credentials import worker_id
from hybridfleet.spec.models import JobSpec


def shard_service_name(spec: JobSpec) -> str:
    return dns_name(spec.name, "ps")


def internal_hosts(spec: JobSpec) -> list[str]:
    """The in-cluster DNS name of every shard, in shard order."""
    svc = shard_service_name(spec)
    return [f"{svc}-{i}.{svc}" for i in range(spec.ps.shards)]


def server_addresses(spec: JobSpec, hosts: list[str] | None = None) -> list[str]:
    """``host:port`` of every shard, in shard order (in-cluster names unless ``hosts`` is given)."""
    return [f"{host}:{PS_PORT}" for host in (hosts or internal_hosts(spec))]


def expected_workers(spec: JobSpec) -> int:
    """What `hfleet run` passes as ``--expected-workers``: the workers that talk to the shards."""
    from hybridfleet.launch.psjob import ps_clients

    return ps_clients(spec)


SNAPSHOT_DIR = "/var/lib/hfleet/snapshots"  # a shard's own volume, when the checkpoint store is not remote
SNAPSHOT_VOLUME_SIZE = "10Gi"  # the claim's request; resize the rendered claim for large models


def snapshots_on_volume(spec: JobSpec) -> bool:
    """True when shards snapshot to a local path: in a pod that needs a volume that outlives it."""
    from hybridfleet.k8s.common import remote_store

    return bool(spec.ps.snapshot_every_steps or spec.ps.snapshot_every_s) and not remote_store(spec)


def shard_command(spec: JobSpec, shard: str, certs_dir: str, snapshot_dir: str | None = None) -> list[str]:
    """`hfleet ps serve` for one shard, with the security flags the job's settings need."""
    command = ["hfleet", "ps", "serve", JOB_FILE, "--shard", shard, "--host", "0.0.0.0", "--port", str(PS_PORT),
               "--expected-workers", str(expected_workers(spec))]
    if snapshot_dir:
        command += ["--snapshot-store", f"file://{snapshot_dir}"]
    if spec.ps.transport != "grpc":
        command += ["--bulk-port", str(PS_BULK_PORT)]
    if tls_on(spec) or tokens_on(spec):
        command += ["--certs", certs_dir]
    if not tls_on(spec):
        command.append("--insecure-plaintext")
    if not tokens_on(spec):
        command.append("--no-auth")
    return command


def worker_command(spec: JobSpec, site: str, site_rank: str, servers: list[str], certs_dir: str) -> list[str]:
    """`hfleet worker` for one worker of ``site``."""
    command = ["hfleet", "worker", JOB_FILE, "--site", site, "--site-rank", site_rank, "--servers", ",".join(servers)]
    if tls_on(spec):
        command += ["--certs", certs_dir]
    else:
        command.append("--insecure-plaintext")
        if tokens_on(spec) and site_rank == "0" and aggregates(spec, site):
            command += ["--certs", certs_dir]  # the site hub checks followers' tokens with the verifying key
    return command


def _ports(spec: JobSpec) -> list[dict[str, Any]]:
    ports = [{"name": "grpc", "containerPort": PS_PORT, "protocol": "TCP"}]
    if spec.ps.transport != "grpc":
        ports.append({"name": "bulk", "containerPort": PS_BULK_PORT, "protocol": "TCP"})
    return ports


def _pod_spec(containers: list[dict], vols: list[dict], options: RenderOptions, group: str | None,
              **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = harden_pod({**extra, "containers": containers, "volumes": vols})
    if options.scheduler == "volcano" and group:
        body["schedulerName"] = "volcano"
    return body


def _template_metadata(pod_labels: dict[str, str], options: RenderOptions, group: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": pod_labels}
    if options.scheduler == "volcano" and group:
        meta["annotations"] = {"scheduling.k8s.io/group-name": group}
    return meta


def shard_manifests(spec: JobSpec, image: str, options: RenderOptions, group: str | None) -> list[Manifest]:
    """The headless Service, the StatefulSet of ``ps.shards`` shards, and one external Service per shard."""
    name = shard_service_name(spec)
    selector = labels(spec, "ps")
    needs_certs = tls_on(spec) or tokens_on(spec)
    vols, mounts = volumes(spec, secret_name(spec, SHARD_ROLE) if needs_certs else None)
    env = [{"name": "HFLEET_SHARD",  # the StatefulSet ordinal (Kubernetes >= 1.28 pod-index label)
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}]
    ports = _ports(spec)
    shard_resources = {"gpus": 0}  # shards aggregate and apply updates on the CPU
    on_volume = snapshots_on_volume(spec)
    if on_volume:
        mounts = [*mounts, {"name": "snapshots", "mountPath": SNAPSHOT_DIR}]
    shard = container(spec, image, "ps", shard_command(spec, "$(HFLEET_SHARD)", CERTS_DIR,
                                                       SNAPSHOT_DIR if on_volume else None),
                      mounts, env=env, ports=ports, resources_override=shard_resources)
    service_ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"]} for p in ports]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, name, "ps"),
               "spec": {"clusterIP": "None", "selector": selector, "ports": service_ports}}
    stateful_set = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(spec, name, "ps"),
                    "spec": {"serviceName": name, "replicas": spec.ps.shards, "podManagementPolicy": "Parallel",
                             "selector": {"matchLabels": selector},
                             "template": {"metadata": _template_metadata(selector, options, group),
                                          "spec": _pod_spec([shard], vols, options, group)}}}
    if on_volume:  # one claim per shard, kept across pod restarts: a restarted shard resumes from its snapshot
        stateful_set["spec"]["volumeClaimTemplates"] = [{
            "metadata": {"name": "snapshots"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": SNAPSHOT_VOLUME_SIZE}}}}]
    out = [service, stateful_set]
    for index, external in enumerate(options.external_names):
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {**metadata(spec, f"{name}-{index}-external", "ps"),
                                 # ExternalDNS publishes the name when it runs in the cluster; else point DNS by hand
                                 "annotations": {"external-dns.alpha.kubernetes.io/hostname": external}},
                    # Local: the client's address reaches the pod, for the shards' NetworkPolicy to check
                    "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                             "selector": {"statefulset.kubernetes.io/pod-name": f"{name}-{index}"},
                             "ports": [dict(p, protocol="TCP") for p in service_ports]}})
    return out


SITE_HUB_PORT = 50060  # an aggregating site's leader (site rank 0) gathers its followers' gradients here


def aggregates(spec: JobSpec, site: str) -> bool:
    """True when ``site`` reduces inside the site first (one leader talks to the shards)."""
    return spec.sites[site].aggregate and spec.sites[site].workers > 1


def site_labels(spec: JobSpec, site: str, site_rank: int | None = None) -> dict[str, str]:
    """The labels of ``site``'s worker pods (of worker ``site_rank`` alone when given)."""
    extra = {"hybridfleet/site": dns_name(site)}
    if site_rank is not None:
        extra["hybridfleet/site-rank"] = str(site_rank)
    return labels(spec, "worker", **extra)


def worker_name(spec: JobSpec, site: str, site_rank: int | None = None) -> str:
    """``<job>-worker-<site>-<rank>``: one worker's Job and its pod's hostname (without a rank: the site's)."""
    return dns_name(spec.name, "worker", site, *(() if site_rank is None else (str(site_rank),)))


def site_hub_service(spec: JobSpec, site: str) -> Manifest:
    """The headless Service that gives an aggregating site's pods stable names (``<worker>.<service>``)."""
    name = worker_name(spec, site)
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, name, "worker"),
            "spec": {"clusterIP": "None", "selector": site_labels(spec, site),
                     "ports": [{"name": "site-hub", "port": SITE_HUB_PORT, "targetPort": SITE_HUB_PORT}]}}


def worker_job(spec: JobSpec, image: str, site: str, site_rank: int, servers: list[str], options: RenderOptions,
               group: str | None) -> Manifest:
    """The Job of worker ``site_rank`` of ``site``: one pod mounting the Secret of that worker alone.

    Its pod's hostname is the Job's name; an aggregating site's pods share the subdomain
    `site_hub_service`, so followers reach the leader (site rank 0) at
    ``<job>-worker-<site>-0.<job>-worker-<site>``.
    """
    needs_secret = tls_on(spec) or tokens_on(spec)
    vols, mounts = volumes(spec, secret_name(spec, site, site_rank) if needs_secret else None)
    env: list[dict[str, Any]] = []
    if tokens_on(spec):
        env.append({"name": "HFLEET_TOKEN_FILE", "value": f"{CERTS_DIR}/{token_file(worker_id(site, site_rank))}"})
    pod_labels = site_labels(spec, site, site_rank)
    name = worker_name(spec, site, site_rank)
    extra: dict[str, Any] = {"restartPolicy": "Never", "hostname": name}
    if aggregates(spec, site):
        hub = worker_name(spec, site)
        env.append({"name": "HFLEET_SITE_HUB", "value": f"{worker_name(spec, site, 0)}.{hub}:{SITE_HUB_PORT}"})
        extra["subdomain"] = hub
    worker = container(spec, image, "worker", worker_command(spec, site, str(site_rank), servers, CERTS_DIR),
                       mounts, env=env)
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": pod_labels},
            "spec": {"completions": 1, "parallelism": 1, "backoffLimit": spec.max_restarts,
                     "template": {"metadata": _template_metadata(pod_labels, options, group),
                                  "spec": _pod_spec([worker], vols, options, group, **extra)}}}


def dialled_hosts(spec: JobSpec, options: RenderOptions) -> list[str]:
    """Every shard host name some rendered worker dials: in-cluster names and the external names."""
    hosts = []
    if options.site is None or options.site == options.shard_site:
        hosts += internal_hosts(spec)
    return hosts + list(options.external_names)


def render_ps(spec: JobSpec, image: str, options: RenderOptions) -> list[Manifest]:
    """The Secrets, shards and worker Jobs of this bundle.

    Without ``options.site``: everything in one cluster. With it: the shard site gets the
    shards (exposed under the external names) and its own workers; any other site gets its
    workers, dialling the external names, and only its own credentials.
    """
    from hybridfleet.k8s.scheduling import pod_group

    with_shards = options.site is None or options.site == options.shard_site
    sites = list(spec.sites) if options.site is None else [options.site]
    if options.credentials.certs_dir is not None and tls_on(spec):
        check_server_names(options.credentials.certs_dir, dialled_hosts(spec, options))
    out: list[Manifest] = []
    wanted: list[tuple[str, int | None]] = [(SHARD_ROLE, None)] if with_shards else []
    wanted += [(site, rank) for site in sites for rank in range(spec.sites[site].workers)]
    out += [s for s in (credential_secret(spec, owner, options.credentials, rank) for owner, rank in wanted)
            if s is not None]
    group = dns_name(spec.name, "gang") if options.scheduler == "volcano" else None
    if group:
        members = (spec.ps.shards if with_shards else 0) + sum(spec.sites[s].workers for s in sites)
        out.append(pod_group(spec, group, members))
    if with_shards:
        out += shard_manifests(spec, image, options, group)
    for site in sites:
        local = options.site is None or site == options.shard_site
        servers = server_addresses(spec, None if local else list(options.external_names))
        if aggregates(spec, site):
            out.append(site_hub_service(spec, site))
        out += [worker_job(spec, image, site, rank, servers, options, group)
                for rank in range(spec.sites[site].workers)]
    return out
