"""Pieces every rendered workload shares: image, labels, resources, volumes, the job ConfigMap."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridfleet.errors import SpecError
from hybridfleet.spec.models import JobSpec

JOB_MOUNT_DIR = "/etc/hfleet/job"
JOB_FILE = f"{JOB_MOUNT_DIR}/job.yaml"
CERTS_DIR = "/etc/hfleet/certs"
PS_PORT = 50051
PS_BULK_PORT = 50052  # the shard's bulk data plane (tensor bytes over TLS)
# Every process runs as this numeric user and group: runAsNonRoot can only be checked by the kubelet
# against a numeric uid (the image's /etc/passwd may not name one), and the same number as fsGroup
# makes the mounted Secrets, emptyDirs and claims readable (and the latter writable) to it alone.
RUN_AS_USER = 10001
HOME_DIR = "/var/lib/hfleet/home"  # HOME: framework caches (~/.cache, matplotlib's config), the data cache
RUN_DIR = "/var/lib/hfleet/run"  # logs and checkpoints of `hfleet launch` (the image's WORKDIR is read-only)
# The only writable paths of a pod: the root filesystem is read-only, these are emptyDirs.
WRITABLE_DIRS = (("tmp", "/tmp"), ("home", HOME_DIR), ("run", RUN_DIR))
SECRET_FILE_MODE = 0o440  # owner root, group fsGroup: the pod's own user reads its credentials
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")

Manifest = dict[str, Any]
APIS = ("v1", "v2")
SCHEDULERS = ("volcano",)

if TYPE_CHECKING:
    from hybridfleet.k8s.credentials import CredentialSource


def _no_credentials() -> "CredentialSource":
    from hybridfleet.k8s.credentials import CredentialSource

    return CredentialSource()


@dataclass(frozen=True)
class RenderOptions:
    """How to render: image, Kubeflow API, which site's bundle, external shard names (and the source
    networks allowed to reach them), credentials, scheduler, the namespace that scrapes metrics."""

    image: str | None = None
    api: str = "v1"
    site: str | None = None  # None: every site in one cluster
    shard_site: str | None = None  # the site whose cluster runs the shards (per-site rendering)
    external_names: tuple[str, ...] = ()  # one per shard: the name other sites dial
    ingress_cidrs: tuple[str, ...] = ()  # the other sites' source networks, allowed to reach the shards
    metrics_namespace: str = "monitoring"  # pods of this namespace may scrape every pod's metrics port
    credentials: "CredentialSource" = field(default_factory=_no_credentials)
    scheduler: str | None = None


def dns_name(*parts: str) -> str:
    """A DNS-1123 name from parts: lower case, ``_`` -> ``-``, joined by ``-``."""
    return "-".join(p.lower().replace("_", "-") for p in parts)


def labels(spec: JobSpec, role: str, **extra: str) -> dict[str, str]:
    """The labels that select one role's pods of this job."""
    return {"app.kubernetes.io/name": "hybridfleet", "app.kubernetes.io/instance": spec.name,
            "hybridfleet/role": role, **extra}


def metadata(spec: JobSpec, name: str, role: str) -> dict[str, Any]:
    return {"name": name, "labels": labels(spec, role)}


def resolve_image(spec: JobSpec, base_dir: Path) -> str | None:
    """``environment.image``, pinned as ``repo@sha256:...`` when the lock file records a digest.

    The lock (``environment.lock``, relative to the job file) may hold ``image`` and/or
    ``image_digest``; a digest inside ``image`` counts too. None when neither names an
    image; raises `SpecError` when the lock is unreadable.
    """
    lock: dict[str, Any] = {}
    if spec.environment.lock:
        lock_path = (base_dir / spec.environment.lock) if not Path(spec.environment.lock).is_absolute() \
            else Path(spec.environment.lock)
        try:
            lock = json.loads(lock_path.read_text())
        except FileNotFoundError:
            raise SpecError(f"environment.lock: no such file {lock_path}") from None
        except json.JSONDecodeError as err:
            raise SpecError(f"environment.lock: {lock_path} is not JSON ({err})") from None
    image = spec.environment.image or lock.get("image")
    if not image:
        return None
    repo, _, embedded = image.partition("@")
    digest = lock.get("image_digest") or embedded or None
    if digest is None:
        return image
    if not _DIGEST.match(digest):
        raise SpecError(f"environment.lock: image_digest must be sha256:<64 hex> (got {digest!r})")
    last = repo.rsplit("/", 1)
    if ":" in last[-1]:  # drop the tag: the digest pins the image
        last[-1] = last[-1].split(":", 1)[0]
    return f"{'/'.join(last)}@{digest}"


def resources(spec: JobSpec, gpus: int | None = None) -> dict[str, Any]:
    """Requests = limits from ``resources`` (guaranteed QoS), plus ``nvidia.com/gpu`` when GPUs are asked.

    ``gpus`` overrides ``resources.gpus`` (shards compute on the CPU and ask for none).
    """
    amounts: dict[str, Any] = {"cpu": cpu_quantity(spec.resources.cpu), "memory": spec.resources.memory}
    wanted = spec.resources.gpus if gpus is None else gpus
    if wanted:
        amounts["nvidia.com/gpu"] = wanted
    return {"requests": dict(amounts), "limits": dict(amounts)}


def cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity: ``2`` or ``500m``."""
    return str(int(cores)) if float(cores).is_integer() else f"{int(round(cores * 1000))}m"


def remote_store(spec: JobSpec) -> bool:
    """True when ``checkpoint.store`` is a URL other than ``file://`` (it outlives the pod)."""
    store = spec.checkpoint.store
    return "://" in store and not store.startswith("file://")


def store_secret_name(spec: JobSpec) -> str:
    """The optional Secret holding the checkpoint store's credentials, read as environment."""
    return dns_name(spec.name, "store")


def config_map(spec: JobSpec, job_text: str) -> Manifest:
    """The job file itself, mounted read-only into every pod at ``/etc/hfleet/job/job.yaml``."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(spec, dns_name(spec.name, "job"), "config"),
            "data": {"job.yaml": job_text}}


def volumes(spec: JobSpec, credentials: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts): the job file, /dev/shm in memory, the writable `WRITABLE_DIRS`
    (emptyDirs under a read-only root filesystem), and the Secret ``credentials`` (mode `SECRET_FILE_MODE`)."""
    vols: list[dict[str, Any]] = [
        {"name": "job", "configMap": {"name": dns_name(spec.name, "job")}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "job", "mountPath": JOB_MOUNT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    for name, path in WRITABLE_DIRS:
        vols.append({"name": name, "emptyDir": {}})
        mounts.append({"name": name, "mountPath": path})
    if credentials:
        vols.append({"name": "certs", "secret": {"secretName": credentials, "defaultMode": SECRET_FILE_MODE}})
        mounts.append({"name": "certs", "mountPath": CERTS_DIR, "readOnly": True})
    return vols, mounts


def pod_security_context() -> dict[str, Any]:
    """The pod-level securityContext of every rendered pod: non-root `RUN_AS_USER`, RuntimeDefault seccomp."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """The securityContext of every rendered container: non-root, read-only root filesystem (the writable
    paths are `WRITABLE_DIRS`), no capabilities, no privilege escalation, RuntimeDefault seccomp."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "privileged": False,
            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def harden_pod(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """``pod_spec`` with the pod securityContext and no service-account token mounted; returns it.

    No rendered process talks to the Kubernetes API, so a pod never holds a token for it.
    """
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["securityContext"] = pod_security_context()
    return pod_spec


def container_env() -> list[dict[str, Any]]:
    """What every container needs under a read-only root: HOME and TMPDIR on emptyDirs, no bytecode writes."""
    return [{"name": "HOME", "value": HOME_DIR}, {"name": "TMPDIR", "value": "/tmp"},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}]


def container(spec: JobSpec, image: str, name: str, command: list[str], mounts: list[dict[str, Any]],
              env: list[dict[str, Any]] | None = None, ports: list[dict[str, Any]] | None = None,
              resources_override: dict[str, int] | None = None) -> dict[str, Any]:
    """One container running ``command`` with the job's image, resources and mounts.

    When the job's checkpoint store is remote (``s3://...``), the container also reads the
    optional Secret `store_secret_name` as environment (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``). Every container carries
    `container_security_context` and `container_env`.
    """
    body: dict[str, Any] = {"name": name, "image": image, "command": command,
                            "resources": resources(spec, **(resources_override or {})), "volumeMounts": mounts,
                            "securityContext": container_security_context()}
    if remote_store(spec):
        body["envFrom"] = [{"secretRef": {"name": store_secret_name(spec), "optional": True}}]
    body["env"] = [*container_env(), *(env or [])]
    if ports:
        body["ports"] = ports
    return body
