"""Run rendered Kubernetes manifests pod by pod on this machine: a test harness, not a product feature.

For every pod `tests/k8s_pods.py` expands from a bundle, this does the kubelet's part:

- its own network namespace (tests/netlab.py); each cluster is one switched
  segment, and clusters are joined by a rate-capped link when asked;
- a hosts file in place of cluster DNS: the pod's hostname (and
  ``<hostname>.<subdomain>`` ...), every Service of its cluster (headless: the pods
  it selects; with a cluster IP: the first pod it selects), each with the short,
  ``.<ns>``, ``.<ns>.svc`` and ``.<ns>.svc.cluster.local`` forms, and the external
  names other clusters expose;
- the container environment: ``envFrom``, ``env`` (values, ``$(VAR)`` references,
  ``fieldRef``, ``secretKeyRef``, ``configMapKeyRef``, ``resourceFieldRef``), then
  what the controller or operator injects, later names winning; ``$(VAR)`` in
  command and args expanded as Kubernetes does;
- volumes at their ``mountPath`` inside a private mount namespace (``unshare -m``):
  ConfigMaps and Secrets as one file per key (or per ``items`` entry), emptyDirs
  as directories (``medium: Memory`` as tmpfs), PersistentVolumeClaims as a
  directory of the pod's own (no storage class, no reattachment elsewhere); a mountPath whose parent does not
  exist (``/etc/hfleet/...``) is made on an overlay of its nearest existing
  ancestor, so nothing outside the pod changes;
- init containers in order, then every container's command; the working
  directory is a fresh copy of the workspace given (it stands for the image's
  WORKDIR), ``hfleet`` is this checkout's;
- the securityContext (container fields over the pod's): ``readOnlyRootFilesystem``
  remounts the whole filesystem read-only inside the pod's mount namespace (the
  workspace included), so only the pod's volumes (emptyDirs, claims, tmpfs) take
  writes; ``runAsUser``/``runAsGroup`` with ``fsGroup`` as the supplementary group run
  the command as that user, with no capabilities and ``no_new_privs``
  (``allowPrivilegeEscalation: false``); Secret and ConfigMap files get ``defaultMode``
  and, with ``fsGroup``, that group, emptyDirs are world-writable and claims
  group-writable, as the kubelet makes them. A pod may only mount its own volumes, so
  a Secret it does not name is not in its filesystem.

What a real cluster adds, and this cannot show: scheduling (nodes, requests and
limits, quotas, gang scheduling), image pulls and the image's own filesystem and
ENV, the kubelet's back-off between restarts and a Job's ``backoffLimit`` (here a
container is restarted in place at once, as ``restartPolicy`` says, at most
``MAX_RESTARTS`` times), rescheduling a pod onto another node, probes, the CNI and kube-proxy (Service virtual IPs and
load balancing; a Service whose port differs from its targetPort is refused),
cluster DNS search paths, NetworkPolicies, seccomp profiles, admission webhooks, the PyTorchJob
init container (names resolve here from the start), service-link env vars,
LoadBalancer provisioning, RBAC and Secret encryption.

Where a bundle cannot run as rendered (a Secret that still holds a placeholder, a
missing key, a volume type it does not know), `HarnessError` says which object and
field.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_pods import Bundle, HarnessError, Pod, Service, expand
from netlab import Host, NetLab

REPO = Path(__file__).resolve().parents[1]
PLACEHOLDER = "REPLACE"
MAX_RESTARTS = 3
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass
class Cluster:
    """One cluster's objects; ``exposes`` maps an external DNS name to one of its Services or pods (what a
    LoadBalancer, NodePort or passthrough route provides), so that other clusters reach it by that name."""

    name: str
    manifests: list[dict[str, Any]]
    exposes: dict[str, str] = field(default_factory=dict)


@dataclass
class PodRun:
    """A started pod: where it lives and what its containers did."""

    pod: Pod
    cluster: str
    host: Host
    directory: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    init_procs: list[subprocess.Popen] = field(default_factory=list)
    returncodes: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    volumes: dict[str, tuple[str, Any]] = field(default_factory=dict)

    def log(self, container: str | None = None) -> str:
        """The output of ``container`` (default: the first one)."""
        name = container or self.pod.spec["containers"][0]["name"]
        path = self.directory / f"{name}.log"
        return path.read_text() if path.exists() else ""

    @property
    def done(self) -> bool:
        return self.error is not None or (
            len(self.returncodes) == len(self.pod.spec["containers"]))


def expand_refs(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` is ``$``, the rest stays."""
    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REF.sub(sub, str(text))


def _secret_value(bundle: Bundle, pod: Pod, ref: dict[str, Any], kind: str) -> str | None:
    store = bundle.secrets if kind == "Secret" else bundle.config_maps
    obj = store.get((pod.namespace, ref["name"]))
    where = f"pod {pod.name}: {kind} {ref['name']!r}"
    if obj is None:
        if ref.get("optional"):
            return None
        raise HarnessError(f"{where} is not in the bundle")
    if ref["key"] not in obj:
        if ref.get("optional"):
            return None
        raise HarnessError(f"{where} has no key {ref['key']!r} (keys: {', '.join(sorted(obj))})")
    value = obj[ref["key"]]
    if PLACEHOLDER in value:
        raise HarnessError(f"{where} key {ref['key']!r} still holds the placeholder {value[:60]!r}; "
                           "create the Secret from real files first")
    return value


def _field(pod: Pod, host: Host, path: str) -> str:
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        table = pod.labels if match.group(1) == "labels" else pod.annotations
        if match.group(2) not in table:
            raise HarnessError(f"pod {pod.name}: fieldRef {path} names a {match.group(1)[:-1]} the pod does not have")
        return table[match.group(2)]
    values = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "metadata.uid": f"uid-{pod.name}",
              "status.podIP": host.address, "status.podIPs": host.address, "status.hostIP": host.address,
              "spec.nodeName": f"node-{host.name}", "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default")}
    if path not in values:
        raise HarnessError(f"pod {pod.name}: fieldRef {path!r} is not emulated")
    return values[path]


def _quantity(text: str) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if str(text).endswith(suffix):
            return float(str(text)[: -len(suffix)]) * scale
    return float(text)


def container_env(bundle: Bundle, pod: Pod, host: Host, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment variables, resolved as the kubelet does."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                obj = (bundle.config_maps if kind == "ConfigMap" else bundle.secrets).get((pod.namespace, source[key]["name"]))
                if obj is None and not source[key].get("optional"):
                    raise HarnessError(f"pod {pod.name}: envFrom {kind} {source[key]['name']!r} is not in the bundle")
                for k in obj or {}:
                    env[prefix + k] = _secret_value(bundle, pod, {"name": source[key]["name"], "key": k}, kind)
    for var in [*container.get("env", []), *pod.operator_env]:
        if "value" in var or "valueFrom" not in var:
            env[var["name"]] = expand_refs(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        if "fieldRef" in src:
            value = _field(pod, host, src["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in src:
            value = _secret_value(bundle, pod, src["secretKeyRef"], "Secret")
        elif "configMapKeyRef" in src:
            value = _secret_value(bundle, pod, src["configMapKeyRef"], "ConfigMap")
        elif "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            section, _, what = ref["resource"].partition(".")
            amount = (container.get("resources", {}).get(section) or {}).get(what)
            if amount is None:
                raise HarnessError(f"pod {pod.name}: resourceFieldRef {ref['resource']} is not set on the container")
            value = str(int(-(-_quantity(amount) // _quantity(ref.get("divisor", "1")))))
        else:
            raise HarnessError(f"pod {pod.name}: env {var['name']}: valueFrom {sorted(src)} is not emulated")
        if value is not None:
            env[var["name"]] = value
    return env


def _size(limit: str | None) -> str:
    if not limit:
        return ""
    return f",size={int(_quantity(limit))}"


def _volume_sources(bundle: Bundle, pod: Pod, directory: Path) -> dict[str, tuple[str, Path | str | None]]:
    """name -> ("bind", dir) for ConfigMaps/Secrets/emptyDirs, ("tmpfs", size) for in-memory emptyDirs."""
    out: dict[str, tuple[str, Path | str | None]] = {}
    fs_group = (pod.spec.get("securityContext") or {}).get("fsGroup")
    for volume in pod.spec.get("volumes", []):
        name = volume["name"]
        target = directory / "volumes" / name
        kind = next((k for k in ("configMap", "secret") if k in volume), None)
        if kind is not None:
            ref = volume[kind]
            obj_name = ref["name"] if kind == "configMap" else ref["secretName"]
            label = "ConfigMap" if kind == "configMap" else "Secret"
            data = (bundle.config_maps if kind == "configMap" else bundle.secrets).get((pod.namespace, obj_name))
            if data is None:
                if ref.get("optional"):
                    data = {}
                else:
                    raise HarnessError(f"pod {pod.name}: volume {name!r}: {label} {obj_name!r} is not in the bundle")
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            target.mkdir(parents=True)
            for item in items:
                value = _secret_value(bundle, pod, {"name": obj_name, "key": item["key"]}, label)
                path = target / item["path"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(value)
                path.chmod(item.get("mode", ref.get("defaultMode", 0o644)))
                if fs_group is not None:
                    os.chown(path, -1, fs_group)
            out[name] = ("bind", target)
        elif "persistentVolumeClaim" in volume:  # the pod's own claim: a directory that outlives its containers
            target.mkdir(parents=True)
            if fs_group is not None:  # the kubelet gives the claim to fsGroup, group-writable, setgid
                os.chown(target, -1, fs_group)
                target.chmod(0o2775)
            out[name] = ("bind", target)
        elif "emptyDir" in volume:
            if (volume["emptyDir"] or {}).get("medium") == "Memory":
                out[name] = ("tmpfs", (volume["emptyDir"] or {}).get("sizeLimit"))
            else:
                target.mkdir(parents=True)
                target.chmod(0o777)  # as the kubelet makes an emptyDir
                out[name] = ("bind", target)
        else:
            raise HarnessError(f"pod {pod.name}: volume {name!r} of type {sorted(set(volume) - {'name'})} is not emulated")
    return out


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def security_context(pod: Pod, container: dict[str, Any]) -> dict[str, Any]:
    """The container's effective securityContext: its own fields over the pod's (``fsGroup`` is the pod's)."""
    return {**(pod.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}


def _privileges(pod: Pod, container: dict[str, Any]) -> list[str]:
    """The ``setpriv`` prefix that drops to the securityContext's user (none when it names no user)."""
    context = security_context(pod, container)
    user = context.get("runAsUser")
    if user is None:
        if context.get("runAsNonRoot"):
            raise HarnessError(f"pod {pod.name}: container {container['name']!r} has runAsNonRoot without a "
                               "numeric runAsUser; the kubelet refuses it unless the image names a non-root USER")
        return []
    if context.get("runAsNonRoot") and int(user) == 0:
        raise HarnessError(f"pod {pod.name}: container {container['name']!r}: runAsNonRoot with runAsUser 0")
    group = context.get("runAsGroup", user)
    extra = context.get("fsGroup")
    groups = f"--groups={extra}" if extra is not None else "--clear-groups"
    prefix = ["setpriv", f"--reuid={user}", f"--regid={group}", groups, "--inh-caps=-all", "--bounding-set=-all"]
    if context.get("allowPrivilegeEscalation") is False:
        prefix.append("--no-new-privs")
    return prefix


def _interpreter_lines() -> list[str]:
    """Lines that let a non-root user reach this machine's Python, which stands in for the image's: when it lies
    under a directory only root may enter (``/root`` for a pyenv build), that directory becomes, in the pod's
    mount namespace only, a tmpfs of mode 0755 holding just the path to the interpreter."""
    python = Path(sys.executable).resolve()
    closed = [d for d in reversed(python.parents) if d != Path("/") and not d.stat().st_mode & 0o001]
    if not closed:
        return []
    top = closed[0]
    keep = python.parents[len(python.parents) - len(top.parts) - 1]  # the entry of ``top`` on the way
    return [f"exec 3< {shlex.quote(str(keep))}", f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(top))}",
            f"mkdir {shlex.quote(str(keep))}", f"mount -c --bind /proc/self/fd/3 {shlex.quote(str(keep))}",
            "exec 3<&-"]


def mount_script(pod: Pod, container: dict[str, Any], volumes: dict[str, tuple[str, Any]], hosts_file: Path,
                 directory: Path) -> str:
    """Shell lines that, in a private mount namespace, put every volume at its mountPath and the hosts file,
    make the root filesystem read-only when the securityContext asks, then run the command as its user."""
    lines = ["set -e", f"hostname {shlex.quote(pod.hostname[:63])}"]
    # what stands in for the image's files: this checkout (its src/ is on PYTHONPATH) and the venv of
    # this interpreter; a volume mounted over one of their ancestors (an emptyDir at /tmp while the
    # checkout lives under /tmp) must not hide them, so they are bound back, read-only, inside it
    image = sorted({REPO, Path(sys.prefix).resolve()}, key=lambda d: len(d.parts))
    image = [d for d in image if not any(o != d and o in d.parents for o in image)]
    covered = [d for d in image if any(Path(m["mountPath"]) == d or Path(m["mountPath"]) in d.parents
                                       for m in container.get("volumeMounts", []))]
    for i, kept in enumerate(covered):
        lines.append(f"exec {5 + i}< {shlex.quote(str(kept))}")
    overlays: list[Path] = []
    read_only_root = bool(security_context(pod, container).get("readOnlyRootFilesystem"))
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: len(Path(m["mountPath"]).parts))
    # a mount over an ancestor of the pod's own directory (/tmp) would hide the volume sources and the
    # workspace: it comes last, and the workspace is bound back at its path inside it
    hiding = [m for m in mounts if directory == Path(m["mountPath"]) or Path(m["mountPath"]) in directory.parents]
    for late in hiding:
        nested = [m["mountPath"] for m in mounts if Path(late["mountPath"]) in Path(m["mountPath"]).parents]
        if nested:
            raise HarnessError(f"pod {pod.name}: mounts under {late['mountPath']} ({', '.join(nested)}) are not emulated")
    mounts = [m for m in mounts if m not in hiding] + hiding
    for mount in mounts:
        target = Path(mount["mountPath"])
        if not target.is_absolute():
            raise HarnessError(f"pod {pod.name}: mountPath {target} is not absolute")
        anchor = _nearest_existing(target)
        if anchor != target and not any(anchor == o or o in anchor.parents for o in overlays):
            if anchor == Path("/"):
                raise HarnessError(f"pod {pod.name}: mountPath {target} would need a new top-level directory")
            work = directory / "overlay" / str(len(overlays))
            (work / "upper").mkdir(parents=True)
            (work / "work").mkdir()
            lines.append(f"mount -t overlay overlay -o lowerdir={anchor},upperdir={work / 'upper'},"
                         f"workdir={work / 'work'} {anchor}")
            overlays.append(anchor)
    lines.append(f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts")
    for mount in mounts:
        name, target = mount["name"], mount["mountPath"]
        if name not in volumes:
            raise HarnessError(f"pod {pod.name}: volumeMount {target} names volume {name!r}, which the pod does not have")
        kind, source = volumes[name]
        if kind == "tmpfs":
            lines += [f"mkdir -p {shlex.quote(target)}",
                      f"mount -t tmpfs -o mode=1777{_size(source)} tmpfs {shlex.quote(target)}"]
        else:
            src = Path(source) / mount.get("subPath", "")
            make = "mkdir -p" if src.is_dir() else "touch"
            if not src.is_dir():
                lines.append(f"mkdir -p {shlex.quote(str(Path(target).parent))}")
            lines += [f"{make} {shlex.quote(target)}", f"mount --bind {shlex.quote(str(src))} {shlex.quote(target)}"]
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
    for i, kept in enumerate(covered):
        quoted = shlex.quote(str(kept))
        lines += [f"mkdir -p {quoted}", f"mount -c --bind /proc/self/fd/{5 + i} {quoted}",
                  f"mount -c -o remount,bind,ro {quoted}", f"exec {5 + i}<&-"]
    privileges = _privileges(pod, container)
    if privileges:
        lines += _interpreter_lines()
    if read_only_root:  # only the root's own mount and the overlays: the volumes keep their own flags
        lines.append("mount -o remount,bind,ro /")
        lines += [f"mount -o remount,bind,ro {shlex.quote(str(anchor))}" for anchor in overlays]
    if hiding:  # the workspace (the shell's working directory) back at its path, as the image's read-only WORKDIR
        lines += ['mkdir -p "$PWD"', 'mount -c --bind /proc/self/cwd "$PWD"', 'cd "$PWD"']
        if read_only_root:
            lines.append('mount -c -o remount,bind,ro "$PWD"')
    lines.append(" ".join(["exec", *privileges, '"$@"']))
    return "\n".join(lines)


def _ports_match(service: Service, pods: list[Pod]) -> None:
    for port in service.ports:
        target = port.get("targetPort", port.get("port"))
        if isinstance(target, str):
            named = [p["containerPort"] for pod in pods for c in pod.spec["containers"]
                     for p in c.get("ports", []) if p.get("name") == target]
            target = named[0] if named else target
        if target != port.get("port"):
            raise HarnessError(f"Service {service.name}: port {port.get('port')} -> targetPort {target} needs "
                               "kube-proxy's port mapping, which the harness does not emulate")


class Kubelet:
    """Pods of every cluster, started together; `wait` returns when every run-to-completion pod ended."""

    def __init__(self, clusters: list[Cluster], workspace: Path, root: Path, wan_mbit: float | None = None):
        self.clusters = clusters
        self.workspace = workspace
        self.root = root
        self.wan_mbit = wan_mbit
        self.lab = NetLab()
        self.bundles: dict[str, Bundle] = {c.name: expand(c.manifests) for c in clusters}
        self.runs: dict[str, PodRun] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def __enter__(self) -> "Kubelet":
        self.lab.__enter__()
        try:
            self._network()
        except BaseException:
            self.lab.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.lab.close()

    def _network(self) -> None:
        for cluster in self.clusters:
            self.lab.segment(cluster.name)
        for other in self.clusters[1:]:
            self.lab.link(other.name, self.clusters[0].name, rate_mbit=self.wan_mbit or 10_000)
        for cluster in self.clusters:
            for pod in self.bundles[cluster.name].pods:
                host = self.lab.host(f"{cluster.name}-{pod.name}", cluster.name)
                key = f"{cluster.name}/{pod.name}"
                self.runs[key] = PodRun(pod, cluster.name, host, self.root / cluster.name / pod.name)
        external = self._external_names()
        for run in self.runs.values():
            run.directory.mkdir(parents=True)
            self.lab.hosts_file(run.host, self._cluster_names(run.cluster, run.pod) + external)

    def plain_host(self, name: str, cluster: str) -> Host:
        """A machine without Kubernetes on ``cluster``'s network; it resolves the names other clusters expose."""
        host = self.lab.host(f"{cluster}-{name}", cluster)
        self.lab.hosts_file(host, [(host.address, [name]), *self._external_names()])
        return host

    def _pods_of(self, cluster: str, service: Service) -> list[PodRun]:
        return [r for r in self.runs.values() if r.cluster == cluster and service.selects(r.pod)]

    def _cluster_names(self, cluster: str, me: Pod) -> list[tuple[str, list[str]]]:
        bundle = self.bundles[cluster]
        services = {(s.namespace, s.name): s for s in bundle.services}
        rows = []
        for run in (r for r in self.runs.values() if r.cluster == cluster):
            pod = run.pod
            names = [pod.hostname] if pod is me else []
            if pod.subdomain and (pod.namespace, pod.subdomain) in services:
                base = f"{pod.hostname}.{pod.subdomain}"
                names += [base, f"{base}.{pod.namespace}", f"{base}.{pod.namespace}.svc",
                          f"{base}.{pod.namespace}.svc.cluster.local"]
            rows.append((run.host.address, names))
        for service in bundle.services:
            behind = self._pods_of(cluster, service)
            if not behind:
                continue
            if not service.headless:
                _ports_match(service, [r.pod for r in behind])
                behind = behind[:1]
            rows += [(r.host.address, service.dns_names()) for r in behind]
        return rows

    def _external_names(self) -> list[tuple[str, list[str]]]:
        rows = []
        for cluster in self.clusters:
            exposes = dict(cluster.exposes)
            for service in self.bundles[cluster.name].services:
                hostname = service.annotations.get("external-dns.alpha.kubernetes.io/hostname")
                if hostname and service.type in ("LoadBalancer", "NodePort"):
                    exposes.setdefault(hostname, service.name)
            for name, target in exposes.items():
                pod = self.runs.get(f"{cluster.name}/{target}")
                if pod is not None:  # one pod behind its own load balancer (e.g. one per StatefulSet ordinal)
                    rows.append((pod.host.address, [name]))
                    continue
                service = next((s for s in self.bundles[cluster.name].services if s.name == target), None)
                if service is None:
                    raise HarnessError(f"cluster {cluster.name}: {name} is exposed by {target!r}, which is neither "
                                       "a Service nor a pod of the bundle")
                behind = self._pods_of(cluster.name, service)
                if not behind:
                    raise HarnessError(f"cluster {cluster.name}: Service {target} selects no pod")
                _ports_match(service, [r.pod for r in behind])
                rows.append((behind[0].host.address, [name]))
        return rows

    def _argv(self, run: PodRun, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        if not container.get("command"):
            raise HarnessError(f"pod {run.pod.name}: container {container['name']!r} has no command; "
                               "the harness cannot know the image's ENTRYPOINT")
        return [expand_refs(a, env) for a in [*container["command"], *container.get("args", [])]]

    def _start(self, run: PodRun, container: dict[str, Any], volumes, workdir: Path,
               restart: int = 0) -> subprocess.Popen:
        bundle = self.bundles[run.cluster]
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
               "PYTHONPATH": str(REPO / "src"), "HOME": str(workdir), "HOSTNAME": run.pod.hostname,
               "OMP_NUM_THREADS": "1", **container_env(bundle, run.pod, run.host, container)}
        argv = self._argv(run, container, env)
        hosts = Path("/etc/netns") / run.host.namespace / "hosts"
        script = mount_script(run.pod, container, volumes, hosts, run.directory / container["name"] / str(restart))
        log = (run.directory / f"{container['name']}.log").open("a" if restart else "w")
        if restart:
            log.write(f"--- restart {restart} ---\n")
            log.flush()
        try:
            return subprocess.Popen([*run.host.exec_prefix, "unshare", "--mount", "--uts", "--propagation", "private",
                                     "sh", "-c", script, "sh", *argv], cwd=workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def _run_pod(self, run: PodRun) -> None:
        try:
            volumes = run.volumes = _volume_sources(self.bundles[run.cluster], run.pod, run.directory)
            workdir = run.directory / "workspace"
            shutil.copytree(self.workspace, workdir, ignore=shutil.ignore_patterns("__pycache__", "runs"))
            for init in run.pod.spec.get("initContainers", []):
                run.init_procs.append(self._start(run, init, volumes, workdir))
                rc = run.init_procs[-1].wait()
                if rc != 0:
                    run.error = f"init container {init['name']} exited {rc}: {run.log(init['name'])[-1500:]}"
                    return
            for container in run.pod.spec["containers"]:
                run.procs[container["name"]] = self._start(run, container, volumes, workdir)
        except HarnessError as err:
            run.error = str(err)
        except Exception as err:  # noqa: BLE001 - reported with the pod's name
            run.error = f"{type(err).__name__}: {err}"

    def start(self) -> None:
        """Start every pod (init containers first, in each pod's own thread)."""
        for run in self.runs.values():
            thread = threading.Thread(target=self._run_pod, args=(run,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _poll(self) -> None:
        """Record exits; restart a container as its pod's restartPolicy says (Always, or OnFailure after a
        non-zero exit), at most ``MAX_RESTARTS`` times, unless the kubelet is stopping."""
        for run in self.runs.values():
            for name, proc in list(run.procs.items()):
                if name in run.returncodes or proc.poll() is None:
                    continue
                policy = run.pod.spec.get("restartPolicy", "Always")
                again = policy == "Always" or (policy == "OnFailure" and proc.returncode != 0)
                if again and not self._stopping and run.restarts.get(name, 0) < MAX_RESTARTS:
                    run.restarts[name] = run.restarts.get(name, 0) + 1
                    container = next(c for c in run.pod.spec["containers"] if c["name"] == name)
                    run.procs[name] = self._start(run, container, run.volumes, run.directory / "workspace",
                                                  restart=run.restarts[name])
                else:
                    run.returncodes[name] = proc.returncode

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every container of ``pod`` (``cluster/name``), as an OOM kill or a crash would."""
        for proc in self.runs[pod].procs.values():
            os.killpg(proc.pid, sig)

    def wait(self, timeout_s: float) -> dict[str, PodRun]:
        """Block until every run-to-completion pod ended (or ``timeout_s``); then stop the others."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            self._poll()
            errors = [f"{k}: {r.error}" for k, r in self.runs.items() if r.error]
            if errors:
                raise HarnessError("; ".join(errors))
            if all(r.done for r in self.runs.values() if r.pod.runs_to_completion):
                break
            time.sleep(0.1)
        self._poll()
        self.stop()
        return self.runs

    def stop(self) -> None:
        """SIGTERM every container still running, SIGKILL after 5 s."""
        self._stopping = True
        procs = [p for r in self.runs.values() for p in [*r.init_procs, *r.procs.values()] if p.poll() is None]
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._poll()


def summary(runs: dict[str, PodRun]) -> str:
    """Each pod's exit codes and the tail of its logs, for assertion messages."""
    parts = []
    for key, run in runs.items():
        parts.append(f"--- {key} {run.returncodes} {run.error or ''}")
        for container in run.pod.spec["containers"]:
            parts.append(run.log(container["name"])[-1500:])
    return "\n".join(parts)
