"""Gang scheduling (Volcano PodGroup) and a team namespace's quota.

With ``--scheduler volcano`` every pod of a PS bundle carries ``schedulerName: volcano``
and the ``scheduling.k8s.io/group-name`` annotation of one PodGroup whose ``minMember``
is the number of pods, so shards and workers start together or not at all (without the
annotation Volcano would make a one-pod group per owner: no gang). Kubeflow jobs get the
same from the operator through ``runPolicy.schedulingPolicy`` when it runs with
``--gang-scheduler-name=volcano``.
"""

from __future__ import annotations

from typing import Any

from hybridfleet.k8s.common import Manifest, cpu_quantity, metadata
from hybridfleet.spec.models import JobSpec


def pod_group(spec: JobSpec, name: str, members: int) -> Manifest:
    """A Volcano PodGroup that admits ``members`` pods at once."""
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
            "metadata": metadata(spec, name, "gang"),
            "spec": {"minMember": members, "queue": "default"}}


def job_pods(spec: JobSpec) -> int:
    """How many pods one run of the job holds at most: shards + workers, or the collective nodes."""
    if spec.mode == "ps":
        return spec.ps.shards + spec.num_workers
    return int(spec.collective.nnodes.split(":")[-1])


def team_quota(spec: JobSpec, pods: int, namespace: str = "team-a") -> list[Manifest]:
    """An example ResourceQuota sized for ``pods`` pods of this job and a LimitRange whose
    defaults are the job's per-pod resources (so a pod without requests still gets them)."""
    cpu_total = spec.resources.cpu * pods
    quota: dict[str, Any] = {"requests.cpu": cpu_quantity(cpu_total), "limits.cpu": cpu_quantity(cpu_total),
                             "requests.memory": _times(spec.resources.memory, pods),
                             "limits.memory": _times(spec.resources.memory, pods), "pods": str(pods)}
    if spec.resources.gpus:
        quota["requests.nvidia.com/gpu"] = str(spec.resources.gpus * pods)
    per_pod = {"cpu": cpu_quantity(spec.resources.cpu), "memory": spec.resources.memory}
    return [
        {"apiVersion": "v1", "kind": "ResourceQuota",
         "metadata": {**metadata(spec, f"{namespace}-quota", "quota"), "namespace": namespace},
         "spec": {"hard": quota}},
        {"apiVersion": "v1", "kind": "LimitRange",
         "metadata": {**metadata(spec, f"{namespace}-limits", "quota"), "namespace": namespace},
         "spec": {"limits": [{"type": "Container", "default": per_pod, "defaultRequest": per_pod}]}},
    ]


def _times(quantity: str, factor: int) -> str:
    """``"4Gi" * 3 -> "12Gi"`` (a Kubernetes quantity times a count)."""
    digits = quantity.rstrip("KMGTiE")
    unit = quantity[len(digits):]
    value = float(digits) * factor
    return f"{int(value) if value.is_integer() else value}{unit}"
