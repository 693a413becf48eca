"""Collective jobs as Kubeflow resources.

- ``--api v1`` (Training Operator, legacy, maintained on release-1.9): ``PyTorchJob`` or
  ``PaddleJob`` (kubeflow.org/v1).
- ``--api v2`` (Kubeflow Trainer, alpha): ``TrainJob`` (trainer.kubeflow.org/v1alpha1) on
  the ``torch-distributed`` runtime. Trainer v2 has no Paddle runtime, so PaddleJob stays v1.

Each pod runs ``hfleet launch`` with exactly the rendezvous variables its operator
injects (see the Kubeflow operators' sources): a PyTorchJob with a Master gets
``MASTER_ADDR``/``MASTER_PORT``/``RANK``; a worker-only elastic PyTorchJob gets only
``PET_RDZV_ENDPOINT``; a PaddleJob gets ``PADDLE_MASTER`` and never a trainer id (paddle's
own master hands out node ranks); a TrainJob gets ``PET_MASTER_ADDR``/``PET_MASTER_PORT``/
``PET_NODE_RANK``.

Restarts have one owner: the operator. ``hfleet launch`` runs with ``--max-restarts 0``
inside the pod; v1 pods use ``restartPolicy: OnFailure`` with ``runPolicy.backoffLimit:
max_restarts`` (``Never`` when it is 0); for v2 the runtime's JobSet failure policy
decides. Checkpoints go to ``checkpoint.store`` when it is a remote URL (a pod's own disk
dies with the pod), under ``<store>/<job name>``.
"""

from __future__ import annotations

from typing import Any

from hybridfleet.errors import SpecError
from hybridfleet.k8s.common import (
    JOB_FILE, RUN_DIR, Manifest, RenderOptions, container, container_env, container_security_context, dns_name,
    harden_pod, metadata,
    pod_security_context, remote_store, volumes,
)
from hybridfleet.launch.preflight import parse_nnodes
from hybridfleet.spec.models import JobSpec

KINDS = {"torch": ("PyTorchJob", "pytorchReplicaSpecs", "pytorch"),
         "paddle": ("PaddleJob", "paddleReplicaSpecs", "paddle")}
TRAINJOB_RUNTIME = "torch-distributed"
TRAINJOB_CONTAINER = "node"  # the torch runtime's trainer container; only it gets the PET_* variables


def checkpoint_location(spec: JobSpec) -> str | None:
    """Where rank 0 writes checkpoints in a pod: ``<checkpoint.store>/<name>`` when the store is remote."""
    if not remote_store(spec):
        return None
    return f"{spec.checkpoint.store.rstrip('/')}/{spec.name}"


def launch_command(spec: JobSpec, master: str, node_rank: str | None) -> list[str]:
    """``hfleet launch`` for one pod; ``master``/``node_rank`` are the operator's variables as ``$(VAR)``."""
    c = spec.collective
    cmd = ["hfleet", "launch", "--framework", spec.framework, "--nproc-per-node", str(c.nproc_per_node),
           "--nnodes", c.nnodes, "--max-restarts", "0", "--log-dir", f"{RUN_DIR}/{spec.name}",
           "--master", master]
    if node_rank is not None:
        cmd += ["--node-rank", node_rank]
    location = checkpoint_location(spec)
    if location:
        cmd += ["--ckpt-dir", location]
    if spec.environment.device == "gpu":
        cmd += ["--device", "gpu"]
    return cmd + [spec.entrypoint, *spec.args]


def _rendezvous_v1(spec: JobSpec, elastic: bool) -> tuple[str, str | None]:
    if spec.framework == "paddle":
        return "$(PADDLE_MASTER)", None
    if elastic:  # worker-only: the operator sets PET_RDZV_ENDPOINT (<job>-worker-0:23456), no MASTER_*
        return "$(PET_RDZV_ENDPOINT)", None
    return "$(MASTER_ADDR):$(MASTER_PORT)", "$(RANK)"


def render_collective_v1(spec: JobSpec, image: str, options: RenderOptions) -> list[Manifest]:
    """The Kubeflow v1 job for ``spec`` (mode: collective), one pod per node."""
    kind, replica_key, container_name = KINDS[spec.framework]
    low, high = parse_nnodes(spec.collective.nnodes)
    elastic = low != high
    if elastic and spec.framework == "paddle":
        raise SpecError("collective.nnodes: elastic MIN:MAX needs an etcd master, which a PaddleJob does not provide; "
                        "use a fixed node count")
    vols, mounts = volumes(spec, None)
    env = [{"name": "HFLEET_JOB_FILE", "value": JOB_FILE}]
    master, rank = _rendezvous_v1(spec, elastic)
    main = container(spec, image, container_name, launch_command(spec, master, rank), mounts, env=env)
    pod_meta = {"labels": metadata(spec, spec.name, "collective")["labels"]}
    restart_policy = "OnFailure" if spec.max_restarts else "Never"

    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": restart_policy,
                "template": {"metadata": pod_meta, "spec": harden_pod({"containers": [main], "volumes": vols})}}

    if spec.framework == "torch" and not elastic:
        replicas = {"Master": replica(1)}
        if high > 1:
            replicas["Worker"] = replica(high - 1)
    else:
        replicas = {"Worker": replica(high)}
    run_policy: dict[str, Any] = {"backoffLimit": spec.max_restarts, "cleanPodPolicy": "Running"}
    if options.scheduler == "volcano":
        run_policy["schedulingPolicy"] = {"minAvailable": low if elastic else high, "queue": "default"}
    body: dict[str, Any] = {replica_key: replicas, "runPolicy": run_policy}
    if spec.framework == "torch":
        body["nprocPerNode"] = str(spec.collective.nproc_per_node)
    if elastic:
        body["elasticPolicy"] = {"minReplicas": low, "maxReplicas": high, "rdzvBackend": "c10d"}
    return [{"apiVersion": "kubeflow.org/v1", "kind": kind, "metadata": metadata(spec, spec.name, "collective"),
             "spec": body}]


def render_trainjob(spec: JobSpec, image: str, options: RenderOptions) -> list[Manifest]:
    """A Kubeflow Trainer v2 ``TrainJob`` on the ``torch-distributed`` runtime (torch only, fixed node count)."""
    if spec.framework != "torch":
        raise SpecError("--api v2: Kubeflow Trainer v2 has no Paddle runtime; render PaddleJob with --api v1")
    low, high = parse_nnodes(spec.collective.nnodes)
    if low != high:
        raise SpecError("collective.nnodes: Kubeflow Trainer v2 has no elastic training; use a fixed node count "
                        "or --api v1")
    vols, mounts = volumes(spec, None)
    command = launch_command(spec, "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", "$(PET_NODE_RANK)")
    main = container(spec, image, TRAINJOB_CONTAINER, command, mounts)
    trainer: dict[str, Any] = {"image": image, "command": command, "numNodes": high,
                               "numProcPerNode": spec.collective.nproc_per_node,
                               "resourcesPerNode": main["resources"],
                               "env": [*container_env(), {"name": "HFLEET_JOB_FILE", "value": JOB_FILE}]}
    # The store's credentials (optional Secret) as single variables: trainer.env has no envFrom.
    for env_from in main.get("envFrom", []):
        name = env_from["secretRef"]["name"]
        trainer["env"] += [{"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": var, "optional": True}}}
                           for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")]
    # The runtime owns the pod template: the patch adds the securityContexts and a service account that
    # mounts no token (runtimePatches cannot set automountServiceAccountToken on the pod itself).
    account = service_account(spec)
    pod_patch = {"volumes": vols, "securityContext": pod_security_context(),
                 "serviceAccountName": account["metadata"]["name"],
                 "containers": [{"name": TRAINJOB_CONTAINER, "volumeMounts": mounts,
                                 "securityContext": container_security_context()}]}
    patch = {"manager": "hybridfleet.io/k8s-render",
             "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                 {"name": "node", "template": {"spec": {"template": {"spec": pod_patch}}}}]}}}}
    meta = metadata(spec, spec.name, "collective")
    if options.scheduler == "volcano":  # the runtime needs podGroupPolicy.volcano; this names the queue
        meta["annotations"] = {"scheduling.volcano.sh/queue-name": "default"}
    return [account, {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta,
             "spec": {"runtimeRef": {"name": TRAINJOB_RUNTIME, "kind": "ClusterTrainingRuntime",
                                     "apiGroup": "trainer.kubeflow.org"},
                      "trainer": trainer, "runtimePatches": [patch]}}]


def service_account(spec: JobSpec) -> Manifest:
    """A ServiceAccount of the job's own, with no API token mounted into its pods and no role bound to it."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": metadata(spec, dns_name(spec.name, "runner"), "service-account"),
            "automountServiceAccountToken": False}


def render_collective(spec: JobSpec, image: str, options: RenderOptions) -> list[Manifest]:
    """The Kubeflow resource for a collective job, per ``options.api``."""
    return render_trainjob(spec, image, options) if options.api == "v2" else render_collective_v1(spec, image, options)
