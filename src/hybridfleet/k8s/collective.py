"""Collective jobs as Kubeflow Training Operator resources: ``PyTorchJob`` or ``PaddleJob`` (kubeflow.org/v1).

Each pod runs ``hfleet launch`` with the rendezvous address the operator puts in its
environment, so the same preflight, logs and restarts apply as on a workstation.
"""

from __future__ import annotations

from hybridfleet.k8s.common import JOB_FILE, Manifest, container, metadata, volumes
from hybridfleet.launch.preflight import parse_nnodes
from hybridfleet.spec.models import JobSpec

KINDS = {"torch": ("PyTorchJob", "pytorchReplicaSpecs", "pytorch"),
         "paddle": ("PaddleJob", "paddleReplicaSpecs", "paddle")}


def _launch_command(spec: JobSpec, nnodes: str) -> list[str]:
    c = spec.collective
    cmd = ["hfleet", "launch", "--framework", spec.framework, "--nproc-per-node", str(c.nproc_per_node),
           "--nnodes", nnodes, "--max-restarts", str(spec.max_restarts), "--log-dir", f"{spec.run_dir}/{spec.name}"]
    if spec.environment.device == "gpu":
        cmd += ["--device", "gpu"]
    if spec.framework == "torch":
        # Set by the training operator in every PyTorchJob pod (RANK is the pod's node rank).
        cmd += ["--master", "$(MASTER_ADDR):$(MASTER_PORT)", "--node-rank", "$(RANK)"]
    else:
        # Set by the training operator; paddle's own master hands out node ranks.
        cmd += ["--master", "$(PADDLE_MASTER)"]
    return cmd + [spec.entrypoint, *spec.args]


def render_collective(spec: JobSpec, image: str) -> list[Manifest]:
    """The Kubeflow job for ``spec`` (mode: collective), one pod per node."""
    kind, replica_key, container_name = KINDS[spec.framework]
    low, high = parse_nnodes(spec.collective.nnodes)
    vols, mounts = volumes(spec, certs=False)
    env = [{"name": "HFLEET_JOB_FILE", "value": JOB_FILE}]
    main = container(spec, image, container_name, _launch_command(spec, spec.collective.nnodes), mounts, env=env)
    template = {"metadata": {"labels": metadata(spec, spec.name, "collective")["labels"]},
                "spec": {"containers": [main], "volumes": vols}}

    def replica(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": template}

    if spec.framework == "torch":
        replicas = {"Master": replica(1)}
        if high > 1:
            replicas["Worker"] = replica(high - 1)
    else:
        replicas = {"Worker": replica(high)}
    body: dict = {replica_key: replicas, "runPolicy": {"backoffLimit": spec.max_restarts, "cleanPodPolicy": "Running"}}
    if spec.framework == "torch":
        body["nprocPerNode"] = str(spec.collective.nproc_per_node)
    if low != high:
        body["elasticPolicy"] = {"minReplicas": low, "maxReplicas": high, "maxRestarts": spec.max_restarts}
    return [{"apiVersion": "kubeflow.org/v1", "kind": kind, "metadata": metadata(spec, spec.name, "collective"),
             "spec": body}]
