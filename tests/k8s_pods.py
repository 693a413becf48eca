"""Rendered Kubernetes manifests as pods: what the controllers and the Kubeflow operators would create.

`expand` reads the objects of a bundle (what `hfleet k8s render` writes) and returns
the pods and Services a cluster would end up with:

- StatefulSet: pods ``<name>-<i>`` with hostname = pod name and subdomain =
  ``serviceName``, the ``apps.kubernetes.io/pod-index`` label, a volume per
  ``volumeClaimTemplates`` entry.
- Deployment: pods ``<name>-<i>``.
- Job (batch/v1): ``parallelism`` pods; Indexed ones carry the
  ``batch.kubernetes.io/job-completion-index`` annotation and label, hostname
  ``<job>-<i>``, and ``JOB_COMPLETION_INDEX`` in every container.
- PyTorchJob / PaddleJob (kubeflow.org/v1): pods ``<job>-<master|worker>-<i>``,
  the default port appended, one headless Service per pod, and the environment
  the operators inject, as listed in tests/schemas/kubeflow/OPERATORS.md
  (sections 1-3).
- TrainJob (trainer.kubeflow.org/v1alpha1): ``numNodes`` pods
  ``<job>-node-0-<i>`` in the headless Service ``<job>``, with the torch plugin's
  ``PET_*`` variables (OPERATORS.md section 5); the trainer's image, command, args
  and env go into container ``node``, and ``runtimePatches`` add volumes, mounts
  and env (and replace the pod's securityContext and serviceAccountName).

`tests/k8s_kubelet.py` runs the pods. Anything else in a bundle (ConfigMaps,
Secrets, Services) is read where pods refer to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CLUSTER_DOMAIN = "cluster.local"
RUNS_TO_COMPLETION = {"Job", "PyTorchJob", "PaddleJob", "TrainJob"}
# kubeflow.org/v1 constants (OPERATORS.md sections 2 and 3)
KUBEFLOW_V1 = {
    "PyTorchJob": {"specs": "pytorchReplicaSpecs", "container": "pytorch", "port_name": "pytorchjob-port",
                   "port": 23456, "operator": "pytorchjob-controller"},
    "PaddleJob": {"specs": "paddleReplicaSpecs", "container": "paddle", "port_name": "master", "port": 36543,
                  "operator": "paddlejob-controller"},
}
TRAINJOB_PORT = 29500


class HarnessError(RuntimeError):
    """The bundle cannot run as rendered; the message names the object and the field."""


@dataclass
class Pod:
    """One pod as the cluster would create it; ``operator_env`` is appended to every container's env."""

    name: str
    owner: str                     # "Kind/name" of the object that made it
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    hostname: str
    subdomain: str | None = None
    operator_env: list[dict[str, Any]] = field(default_factory=list)

    @property
    def runs_to_completion(self) -> bool:
        return self.owner.split("/")[0] in RUNS_TO_COMPLETION


@dataclass
class Service:
    """A Service: its selector (None: no selector) and whether it is headless."""

    name: str
    namespace: str
    selector: dict[str, str] | None
    headless: bool
    ports: list[dict[str, Any]]
    type: str = "ClusterIP"
    annotations: dict[str, str] = field(default_factory=dict)

    def selects(self, pod: Pod) -> bool:
        return self.selector is not None and pod.namespace == self.namespace and all(
            pod.labels.get(k) == v for k, v in self.selector.items())

    def dns_names(self) -> list[str]:
        ns = self.namespace
        return [self.name, f"{self.name}.{ns}", f"{self.name}.{ns}.svc", f"{self.name}.{ns}.svc.{CLUSTER_DOMAIN}"]


@dataclass
class Bundle:
    """The objects of one cluster: pods, Services, and the ConfigMaps/Secrets pods refer to."""

    pods: list[Pod]
    services: list[Service]
    config_maps: dict[tuple[str, str], dict[str, str]]
    secrets: dict[tuple[str, str], dict[str, str]]


def load_manifests(directory: Path) -> list[dict[str, Any]]:
    """Every object of every ``*.yaml``/``*.yml`` file in ``directory`` (sorted by file name)."""
    out = []
    for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
        out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _ns(obj: dict[str, Any]) -> str:
    return obj.get("metadata", {}).get("namespace") or "default"


def _template(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """The pod template of a workload (``spec.template``) or of a replica spec (``template``)."""
    template = obj.get("spec", {}).get("template") if "spec" in obj else obj.get("template")
    if not template or "spec" not in template:
        raise HarnessError(f"{where}: the pod template (template.spec) is missing")
    return copy.deepcopy(template)


def _pod(owner: str, name: str, obj: dict[str, Any], template: dict[str, Any], hostname: str | None = None,
         subdomain: str | None = None, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> Pod:
    meta = template.get("metadata", {})
    spec = template["spec"]
    return Pod(name=name, owner=owner, namespace=_ns(obj),
               labels={**meta.get("labels", {}), **(labels or {})},
               annotations={**meta.get("annotations", {}), **(annotations or {})}, spec=spec,
               hostname=spec.get("hostname") or hostname or name, subdomain=spec.get("subdomain") or subdomain)


def _statefulset(obj: dict[str, Any]) -> list[Pod]:
    """Pods ``<name>-<i>``; each ``volumeClaimTemplates`` entry becomes a volume of that name, which the
    kubelet emulation backs with a directory of the pod's own (its PersistentVolume)."""
    name = obj["metadata"]["name"]
    template = _template(obj, f"StatefulSet/{name}")
    for claim in obj["spec"].get("volumeClaimTemplates", []):
        template["spec"].setdefault("volumes", []).append(
            {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}})
    return [_pod(f"StatefulSet/{name}", f"{name}-{i}", obj, copy.deepcopy(template), subdomain=obj["spec"].get("serviceName"),
                 labels={"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": f"{name}-{i}"})
            for i in range(obj["spec"].get("replicas", 1))]


def _deployment(obj: dict[str, Any]) -> list[Pod]:
    name = obj["metadata"]["name"]
    template = _template(obj, f"Deployment/{name}")
    return [_pod(f"Deployment/{name}", f"{name}-{i}", obj, copy.deepcopy(template))
            for i in range(obj["spec"].get("replicas", 1))]


def _job(obj: dict[str, Any]) -> list[Pod]:
    name, spec = obj["metadata"]["name"], obj["spec"]
    template = _template(obj, f"Job/{name}")
    count = spec.get("parallelism", 1)
    if spec.get("completions") is not None:
        count = min(count, spec["completions"])
    pods = []
    for i in range(count):
        if spec.get("completionMode") == "Indexed":
            key = "batch.kubernetes.io/job-completion-index"
            pod = _pod(f"Job/{name}", f"{name}-{i}", obj, copy.deepcopy(template), hostname=f"{name}-{i}",
                       labels={key: str(i), "job-name": name}, annotations={key: str(i)})
            pod.operator_env.append({"name": "JOB_COMPLETION_INDEX", "value": str(i)})
        else:
            pod = _pod(f"Job/{name}", f"{name}-{i}", obj, copy.deepcopy(template), labels={"job-name": name})
        pods.append(pod)
    return pods


def _default_port(container: dict[str, Any], consts: dict[str, Any]) -> int:
    """The operator's port defaulting: append ``{name: <port name>, containerPort: <default>}`` if missing."""
    ports = container.setdefault("ports", [])
    for port in ports:
        if port.get("name") == consts["port_name"]:
            return int(port["containerPort"])
    ports.append({"name": consts["port_name"], "containerPort": consts["port"]})
    return consts["port"]


def _kubeflow_v1(obj: dict[str, Any]) -> tuple[list[Pod], list[Service]]:
    kind, name = obj["kind"], obj["metadata"]["name"]
    consts = KUBEFLOW_V1[kind]
    raw = obj["spec"].get(consts["specs"]) or {}
    specs = {key[0].upper() + key[1:].lower(): value for key, value in raw.items()}
    unknown = set(specs) - {"Master", "Worker"}
    if unknown:
        raise HarnessError(f"{kind}/{name}: replica types {sorted(unknown)} are rejected by the webhook")
    ports: dict[str, int] = {}
    templates: dict[str, dict[str, Any]] = {}
    for rtype, rspec in specs.items():
        template = _template(rspec, f"{kind}/{name} {consts['specs']}.{rtype}")
        containers = template["spec"].get("containers", [])
        named = [c for c in containers if c.get("name") == consts["container"]]
        if not named:
            raise HarnessError(f"{kind}/{name} {rtype}: no container named {consts['container']!r} "
                               "(the operator's webhook requires one)")
        ports[rtype] = _default_port(named[0], consts)
        templates[rtype] = template
    total = sum(int(s.get("replicas", 1)) for s in specs.values())
    pods, services = [], []
    for rtype, rspec in specs.items():
        for i in range(int(rspec.get("replicas", 1))):
            pod_name = f"{name}-{rtype.lower()}-{i}"
            labels = {"training.kubeflow.org/operator-name": consts["operator"],
                      "training.kubeflow.org/job-name": name,
                      "training.kubeflow.org/replica-type": rtype.lower(),
                      "training.kubeflow.org/replica-index": str(i)}
            master_role = (rtype == "Master") or (kind == "PyTorchJob" and "Master" not in specs and i == 0)
            if master_role:
                labels["training.kubeflow.org/job-role"] = "master"
            pod = _pod(f"{kind}/{name}", pod_name, obj, copy.deepcopy(templates[rtype]), labels=labels)
            pod.spec["restartPolicy"] = {"ExitCode": "Never"}.get(rspec.get("restartPolicy", "OnFailure"),
                                                                   rspec.get("restartPolicy", "OnFailure"))
            env = _pytorch_env(obj, specs, ports, rtype, i, total) if kind == "PyTorchJob" \
                else _paddle_env(obj, specs, ports, rtype, i, total)
            pod.operator_env.extend(env)
            pods.append(pod)
            default = next(c for c in pod.spec["containers"] if c.get("name") == consts["container"])
            services.append(Service(name=pod_name, namespace=_ns(obj), headless=True,
                                    selector={k: v for k, v in labels.items() if k != "training.kubeflow.org/job-role"},
                                    ports=[{"name": p.get("name"), "port": p["containerPort"]}
                                           for p in default.get("ports", [])]))
    return pods, services


def _pytorch_env(job: dict[str, Any], specs: dict[str, Any], ports: dict[str, int], rtype: str, index: int,
                 total: int) -> list[dict[str, Any]]:
    """OPERATORS.md section 2, in the operator's append order."""
    name, spec = job["metadata"]["name"], job["spec"]
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    nproc_text = str(spec.get("nprocPerNode", "auto"))
    nproc = int(nproc_text) if nproc_text.isdigit() else 1
    if "Master" in specs:
        env += [{"name": "MASTER_PORT", "value": str(ports["Master"])},
                {"name": "PET_MASTER_PORT", "value": str(ports["Master"])},
                {"name": "MASTER_ADDR", "value": f"{name}-master-0"},
                {"name": "PET_MASTER_ADDR", "value": f"{name}-master-0"},
                {"name": "WORLD_SIZE", "value": str(total * nproc)}]
        rank = 0 if rtype == "Master" else index + 1
        env += [{"name": "RANK", "value": str(rank)}, {"name": "PET_NODE_RANK", "value": str(rank)}]
    elastic = spec.get("elasticPolicy")
    if elastic is None or elastic.get("nProcPerNode") is None:
        env.append({"name": "PET_NPROC_PER_NODE", "value": nproc_text})
    if elastic is None:
        env.append({"name": "PET_NNODES", "value": str(total)})
    else:
        workers = int(specs.get("Worker", {}).get("replicas", 1))
        low = elastic.get("minReplicas", elastic.get("maxReplicas", workers))
        high = elastic.get("maxReplicas", low)
        host = elastic.get("rdzvHost") or f"{name}-worker-0"
        env += [{"name": "PET_RDZV_ENDPOINT", "value": f"{host}:{elastic.get('rdzvPort') or ports['Worker']}"},
                {"name": "PET_RDZV_BACKEND", "value": elastic.get("rdzvBackend") or "c10d"},
                {"name": "PET_NNODES", "value": f"{low}:{high}"}]
        if elastic.get("maxRestarts") is not None:
            env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
    return env


def _paddle_env(job: dict[str, Any], specs: dict[str, Any], ports: dict[str, int], rtype: str, index: int,
                total: int) -> list[dict[str, Any]]:
    """OPERATORS.md section 3: no PADDLE_TRAINER_ID, no MASTER_ADDR/RANK/WORLD_SIZE."""
    name = job["metadata"]["name"]
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "PADDLE_JOB_ID", "value": name},
           {"name": "PADDLE_NNODES", "value": str(total)}]
    lead = "Master" if "Master" in specs else "Worker"
    if rtype == lead and index == 0:
        env += [{"name": "POD_IP_DUMMY", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "PADDLE_MASTER", "value": f"$(POD_IP_DUMMY):{ports[lead]}"}]
    else:
        env.append({"name": "PADDLE_MASTER", "value": f"{name}-{lead.lower()}-0:{ports[lead]}"})
    if lead == "Master":
        env.append({"name": "PADDLE_SERVER_NUM" if rtype == "Master" else "PADDLE_TRAINER_NUM", "value": "1"})
    return env


def _merge_containers(base: list[dict[str, Any]], patch: list[dict[str, Any]]) -> None:
    """Strategic merge by container name: lists of env/volumeMounts/ports are appended, the rest replaced."""
    for update in patch:
        target = next((c for c in base if c.get("name") == update.get("name")), None)
        if target is None:
            base.append(copy.deepcopy(update))
            continue
        for key, value in update.items():
            if isinstance(value, list) and key in ("env", "volumeMounts", "ports", "envFrom"):
                target.setdefault(key, []).extend(copy.deepcopy(value))
            else:
                target[key] = copy.deepcopy(value)


def _trainjob(obj: dict[str, Any], runtimes: dict[str, dict[str, Any]]) -> tuple[list[Pod], list[Service]]:
    name, spec = obj["metadata"]["name"], obj["spec"]
    trainer = spec.get("trainer") or {}
    runtime_name = (spec.get("runtimeRef") or {}).get("name")
    pod_spec: dict[str, Any] = {"containers": [{"name": "node"}], "restartPolicy": "Never"}
    runtime = runtimes.get(runtime_name or "")
    if runtime is not None:
        for rjob in runtime["spec"]["template"]["spec"].get("replicatedJobs", []):
            if rjob.get("name") == "node":
                pod_spec = copy.deepcopy(rjob["template"]["spec"]["template"]["spec"])
    node = next((c for c in pod_spec["containers"] if c.get("name") == "node"), None)
    if node is None:
        raise HarnessError(f"TrainJob/{name}: runtime {runtime_name!r} has no container 'node'")
    for key in ("image", "command", "args"):
        if key in trainer:
            node[key] = copy.deepcopy(trainer[key])
    node.setdefault("env", []).extend(copy.deepcopy(trainer.get("env", [])))
    for patch in spec.get("runtimePatches") or []:
        template = (patch.get("trainingRuntimeSpec") or {}).get("template", {}).get("spec", {})
        for rjob in template.get("replicatedJobs", []):
            if rjob.get("name") not in (None, "node"):
                continue
            patch_spec = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            pod_spec.setdefault("volumes", []).extend(copy.deepcopy(patch_spec.get("volumes", [])))
            for key in ("securityContext", "serviceAccountName"):  # replaced, as a strategic merge does
                if key in patch_spec:
                    pod_spec[key] = copy.deepcopy(patch_spec[key])
            _merge_containers(pod_spec["containers"], patch_spec.get("containers", []))
    reserved = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    clash = reserved & {e["name"] for e in trainer.get("env", [])}
    if clash:
        raise HarnessError(f"TrainJob/{name}: spec.trainer.env sets {sorted(clash)}, which the webhook rejects")
    nodes = int(trainer.get("numNodes", 1))
    nproc = str(trainer.get("numProcPerNode", "auto"))
    if nproc == "auto":
        cpu = str(((trainer.get("resourcesPerNode") or {}).get("requests") or {}).get("cpu", "1"))
        nproc = str(max(1, int(float(cpu[:-1]) / 1000) if cpu.endswith("m") else int(float(cpu))))
    node.setdefault("ports", []).append({"containerPort": TRAINJOB_PORT})
    pods = []
    for i in range(nodes):
        pod_name = f"{name}-node-0-{i}"
        key = "batch.kubernetes.io/job-completion-index"
        pod = _pod(f"TrainJob/{name}", pod_name, obj, {"spec": copy.deepcopy(pod_spec)}, hostname=pod_name,
                   subdomain=name, labels={"trainer.kubeflow.org/trainjob-ancestor-step": "trainer",
                                           "jobset.sigs.k8s.io/jobset-name": name, key: str(i)},
                   annotations={key: str(i)})
        pod.operator_env += [{"name": "PET_NNODES", "value": str(nodes)},
                             {"name": "PET_NPROC_PER_NODE", "value": nproc},
                             {"name": "PET_NODE_RANK", "value": str(i)},
                             {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
                             {"name": "PET_MASTER_PORT", "value": str(TRAINJOB_PORT)}]
        pods.append(pod)
    service = Service(name=name, namespace=_ns(obj), headless=True,
                      selector={"jobset.sigs.k8s.io/jobset-name": name}, ports=[])
    return pods, [service]


def _data(obj: dict[str, Any]) -> dict[str, str]:
    import base64

    out = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()} \
        if obj["kind"] == "Secret" else dict(obj.get("data") or {})
    out.update(obj.get("stringData") or {})
    return out


def expand(manifests: list[dict[str, Any]]) -> Bundle:
    """The pods and Services the objects in ``manifests`` make, with the ConfigMaps and Secrets."""
    pods: list[Pod] = []
    services: list[Service] = []
    config_maps, secrets = {}, {}
    runtimes = {m["metadata"]["name"]: m for m in manifests
                if m.get("kind") in ("ClusterTrainingRuntime", "TrainingRuntime")}
    for obj in manifests:
        kind = obj.get("kind")
        if kind == "StatefulSet":
            pods += _statefulset(obj)
        elif kind == "Deployment":
            pods += _deployment(obj)
        elif kind == "Job":
            pods += _job(obj)
        elif kind in KUBEFLOW_V1:
            more_pods, more_services = _kubeflow_v1(obj)
            pods += more_pods
            services += more_services
        elif kind == "TrainJob":
            more_pods, more_services = _trainjob(obj, runtimes)
            pods += more_pods
            services += more_services
        elif kind == "Service":
            spec = obj.get("spec", {})
            services.append(Service(name=obj["metadata"]["name"], namespace=_ns(obj), selector=spec.get("selector"),
                                    headless=spec.get("clusterIP") == "None", ports=spec.get("ports", []),
                                    type=spec.get("type", "ClusterIP"),
                                    annotations=obj["metadata"].get("annotations") or {}))
        elif kind == "ConfigMap":
            config_maps[(_ns(obj), obj["metadata"]["name"])] = _data(obj)
        elif kind == "Secret":
            secrets[(_ns(obj), obj["metadata"]["name"])] = _data(obj)
    return Bundle(pods, services, config_maps, secrets)
