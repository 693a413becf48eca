"""`hfleet run` for parameter-server jobs: shards, workers and site baselines on this machine.

The run directory ``<run_dir>/<name>/<timestamp>/`` receives ``logs/`` (one file
per process), ``events.jsonl`` (starts, exits, restarts), ``metrics.jsonl``
(every ``metrics`` record the workers log), ``certs/`` (the job's dev CA, server
and client certificates and token-signing key, when security is on) and
``summary.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridfleet.errors import EXIT_CODES, LaunchError, PortInUseError
from hybridfleet.launch.preflight import free_port
from hybridfleet.launch.supervisor import ProcessSpec, Supervisor, run_supervised
from hybridfleet.obs.log import get_logger
from hybridfleet.spec.models import JobSpec

log = get_logger("run")

SHARD_START_TIMEOUT_S = 60.0


@dataclass
class RunLayout:
    """Paths and credentials of one run."""

    run_dir: Path
    certs_dir: Path | None
    tokens: dict[str, str] = field(default_factory=dict)   # site (or "admin") -> token
    shard_addresses: list[str] = field(default_factory=list)


def new_run_dir(spec: JobSpec, root: str | os.PathLike[str] | None = None) -> Path:
    """``<root>/<name>/<UTC timestamp>``, unique even when two runs start in the same second."""
    base = Path(root or spec.run_dir) / spec.name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = base / stamp
    n = 1
    while path.exists():
        n += 1
        path = base / f"{stamp}-{n}"
    path.mkdir(parents=True)
    return path


def prepare_security(spec: JobSpec, run_dir: Path) -> RunLayout:
    """Make the job's dev CA, certificates and signing key, and one token per site (plus an admin token)."""
    layout = RunLayout(run_dir=run_dir, certs_dir=None)
    if spec.security.tls == "off" and spec.security.tokens == "off":
        return layout
    from hybridfleet.security import TokenIssuer, generate_signing_key, make_dev_pki
    from hybridfleet.security.tokens import SIGNING_KEY

    certs = run_dir / "certs"
    if spec.security.tls not in ("auto", "off"):
        certs = Path(spec.security.tls)
    else:
        make_dev_pki(certs, hosts=sorted({spec.ps.host, "127.0.0.1", "localhost"}), clients=["worker"])
    layout.certs_dir = certs
    if spec.security.tokens == "auto":
        if not (certs / SIGNING_KEY).exists():
            generate_signing_key(certs)
        issuer = TokenIssuer.from_dir(certs)
        ttl = spec.security.token_ttl_s
        for site in spec.sites:
            layout.tokens[site] = issuer.issue(spec.name, site, "worker", ttl, subject=f"site:{site}")
        layout.tokens["admin"] = issuer.issue(spec.name, "-", "admin", ttl, subject="hfleet-run")
    return layout


def ps_clients(spec: JobSpec) -> int:
    """How many workers talk to the shards: one leader per aggregating site, every worker elsewhere."""
    return sum(1 if s.aggregate and s.workers > 1 else s.workers for s in spec.sites.values())


def snapshot_store(spec: JobSpec, run_dir: Path) -> str:
    """The job's ``checkpoint.store`` when the job file names one, else ``<run_dir>/snapshots``."""
    if "store" in spec.checkpoint.model_fields_set:
        return spec.checkpoint.store
    return f"file://{run_dir.resolve() / 'snapshots'}"


def shard_process(spec: JobSpec, job_path: Path, layout: RunLayout, shard: int) -> ProcessSpec:
    """The `hfleet ps serve` process of one shard; it writes its bound port to ``run_dir/shard-N.port``.

    The shard binds its own port (0: the kernel picks, nothing is picked and released
    here for another process to take); a restarted shard binds the port its port file
    names, where its workers left it. A shard that cannot have its port exits with the
    `port_in_use` code and is not restarted: retrying cannot free the port.
    """
    port = spec.ps.base_port + shard if spec.ps.base_port else 0
    argv = [sys.executable, "-m", "hybridfleet", "ps", "serve", str(job_path), "--shard", str(shard),
            "--host", spec.ps.host, "--port", str(port),
            "--port-file", str(layout.run_dir / f"shard-{shard}.port"),
            "--expected-workers", str(ps_clients(spec)),
            "--snapshot-store", snapshot_store(spec, layout.run_dir)]
    if layout.certs_dir is not None:
        argv += ["--certs", str(layout.certs_dir)]
    if spec.security.tls == "off":
        argv.append("--insecure-plaintext")
    if spec.security.tokens == "off":
        argv.append("--no-auth")
    return ProcessSpec(name=f"shard-{shard}", argv=argv, role="shard", max_restarts=spec.max_restarts,
                       env={"OMP_NUM_THREADS": "1"}, final_exit_codes=(EXIT_CODES["port_in_use"].code,))


def worker_env(spec: JobSpec, job_path: Path, layout: RunLayout, site: str, rank: int, site_rank: int,
               with_servers: bool = True) -> dict[str, str]:
    """The ``HFLEET_*`` variables a worker script reads (see `hybridfleet.ps.worker.session.WorkerConfig`)."""
    env = {"HFLEET_JOB": str(job_path), "HFLEET_SITE": site, "HFLEET_RANK": str(rank),
           "HFLEET_SITE_RANK": str(site_rank), "HFLEET_RUN_DIR": str(layout.run_dir), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    if with_servers:
        env["HFLEET_SERVERS"] = ",".join(layout.shard_addresses)
        if spec.security.tls == "off":
            env["HFLEET_INSECURE"] = "1"
        elif layout.certs_dir is not None:
            from hybridfleet.security import load_pki

            pki = load_pki(layout.certs_dir)
            env["HFLEET_CA_CERT"] = str(pki.ca_cert)
            if spec.security.mutual_tls:
                env["HFLEET_CLIENT_CERT"] = str(pki.clients["worker"].cert)
                env["HFLEET_CLIENT_KEY"] = str(pki.clients["worker"].key)
        if site in layout.tokens:
            env["HFLEET_TOKEN"] = layout.tokens[site]
    return env


def worker_processes(spec: JobSpec, job_path: Path, layout: RunLayout) -> list[ProcessSpec]:
    """One process per worker of every site; global ranks follow the order of ``sites``."""
    procs, rank = [], 0
    entry = str(Path(spec.entrypoint))
    for site, s in spec.sites.items():
        hub = f"127.0.0.1:{free_port()}" if s.aggregate and s.workers > 1 else None
        for site_rank in range(s.workers):
            prefix = ["ip", "netns", "exec", s.netns] if s.netns else []
            procs.append(ProcessSpec(name=f"worker-{site}-{site_rank}",
                                     argv=[*prefix, sys.executable, entry, *spec.args],
                                     env={**worker_env(spec, job_path, layout, site, rank, site_rank),
                                          **({"HFLEET_SITE_HUB": hub} if hub else {})},
                                     max_restarts=spec.max_restarts, role="worker"))
            rank += 1
    return procs


def baseline_processes(spec: JobSpec, job_path: Path, layout: RunLayout) -> list[ProcessSpec]:
    """Each site training alone on its own data (no servers), for comparison."""
    return [ProcessSpec(name=f"baseline-{site}", argv=[sys.executable, str(spec.entrypoint), *spec.args],
                        env=worker_env(spec, job_path, layout, site, 0, 0, with_servers=False), role="baseline")
            for site in spec.sites]


class MetricsCollector:
    """Appends every ``metrics`` log record of a process to metrics.jsonl and keeps the final ones."""

    def __init__(self, path: Path):
        self.path = path
        self.final: dict[str, dict] = {}
        self.last: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._file = path.open("a")

    def on_line(self, process: str, line: str) -> None:
        if not line.startswith("{") or '"metrics"' not in line:
            return
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            return
        if rec.get("event") != "metrics":
            return
        rec["process"] = process
        with self._lock:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
            self.last[process] = rec
            if rec.get("final"):
                self.final[process] = rec

    def close(self) -> None:
        self._file.close()


def _wait_for_ports(layout: RunLayout, num_shards: int, sup: Supervisor) -> list[str]:
    deadline = time.monotonic() + SHARD_START_TIMEOUT_S
    files = [layout.run_dir / f"shard-{i}.port" for i in range(num_shards)]
    while time.monotonic() < deadline:
        if all(f.exists() and f.read_text().strip() for f in files):
            return [f.read_text().strip() for f in files]
        for i in range(num_shards):
            rc = sup.returncode(f"shard-{i}")
            if rc is not None and rc != 0:
                log_path = layout.run_dir / "logs" / f"shard-{i}.log"
                if rc == EXIT_CODES["port_in_use"].code:
                    raise PortInUseError(f"shard {i} could not bind its port; see {log_path}",
                                         hint="free the port, or leave ps.base_port unset so each shard takes a free one")
                raise LaunchError(f"shard {i} exited with code {rc} before serving; see {log_path}",
                                  hint=f"the shard's own error is at the end of {log_path}")
        time.sleep(0.05)
    raise LaunchError(f"shards did not start within {SHARD_START_TIMEOUT_S:.0f} s; see {layout.run_dir}/logs/",
                      hint=f"the shard logs in {layout.run_dir}/logs/ say where they stopped")


def _progress_fn(spec: JobSpec, layout: RunLayout, collector: MetricsCollector):
    """Progress from shard 0's version (one per applied round in BSP, one per push otherwise)."""
    from hybridfleet.ps.worker.status import ShardStatusProbe

    probe = ShardStatusProbe(layout.shard_addresses[0], layout.certs_dir, layout.tokens.get("admin"),
                             insecure=spec.security.tls == "off")
    total = spec.train.steps * (1 if spec.ps.sync == "bsp" else spec.num_workers)

    def progress() -> tuple[float, float, str]:
        version = probe.version()
        done = len(collector.final)
        return float(min(version, total)), float(total), f"{spec.name}: round {version} ({done} done)"

    return progress, probe


def _datasets_by_site(spec: JobSpec, workers: dict[str, dict]) -> dict[str, dict[str, str]]:
    """Each site's packed datasets (URL -> manifest sha256) as its workers reported reading them."""
    out: dict[str, dict[str, str]] = {s: {} for s in spec.sites}
    for rec in workers.values():
        out.setdefault(rec.get("site", "?"), {}).update(rec.get("datasets") or {})
    return out


def _privacy_by_site(spec: JobSpec, workers: dict[str, dict]) -> dict[str, dict] | None:
    """(epsilon, delta) each site spent, from its workers' final records; None without ps.privacy."""
    if spec.ps.privacy is None:
        return None
    out: dict[str, dict] = {}
    for rec in workers.values():
        if "dp_epsilon" in rec:
            site = out.setdefault(rec["site"], {"epsilon": 0.0, "delta": rec["dp_delta"]})
            site["epsilon"] = max(site["epsilon"], rec["dp_epsilon"])
    return out


def summarize(spec: JobSpec, layout: RunLayout, collector: MetricsCollector, codes: dict[str, int],
              sup: Supervisor, wall_s: float) -> dict:
    """summary.json: joint accuracy, each site's accuracy alone, bytes per site, restarts."""
    workers = {n: r for n, r in collector.final.items() if n.startswith("worker-")}
    baselines = {n[len("baseline-"):]: r for n, r in collector.final.items() if n.startswith("baseline-")}
    by_site_sent: dict[str, int] = {s: 0 for s in spec.sites}
    by_site_received: dict[str, int] = {s: 0 for s in spec.sites}
    raw_data = 0
    for rec in collector.last.values():
        if rec.get("process", "").startswith("worker-"):
            by_site_sent[rec["site"]] += int(rec.get("sent", 0))
            by_site_received[rec["site"]] += int(rec.get("received", 0))
            raw_data += int(rec.get("raw_data_sent", 0))
    accs = [r["test_accuracy"] for r in workers.values() if "test_accuracy" in r]
    restarts = sum(1 for e in sup.events if e.get("event") == "restart")
    worker_codes = {n: c for n, c in codes.items() if n.startswith("worker-")}
    finished = [n for n, c in worker_codes.items() if c == 0 and n in workers]
    if finished and len(finished) == spec.num_workers:
        status = "completed"
    elif finished:
        status = "degraded"  # some workers died for good; the others trained to the end
    else:
        status = "failed"
    return {
        "job": spec.name, "framework": spec.framework, "sync": spec.ps.sync, "shards": spec.ps.shards,
        "workers": spec.num_workers, "status": status,
        "test_accuracy": round(min(accs), 5) if accs else None,  # the worst worker's view of the model
        "test_accuracy_by_worker": {n: r["test_accuracy"] for n, r in sorted(workers.items())},
        "site_alone_accuracy": {s: r.get("test_accuracy") for s, r in sorted(baselines.items())},
        "bytes_sent_by_site": by_site_sent, "bytes_received_by_site": by_site_received,
        "privacy_by_site": _privacy_by_site(spec, workers),
        "raw_data_bytes_sent": raw_data, "datasets_by_site": _datasets_by_site(spec, workers),
        "restarts": restarts, "exit_codes": codes, "wall_s": round(wall_s, 2),
        "run_dir": str(layout.run_dir),
    }


def run_ps_job(spec: JobSpec, job_path: str | os.PathLike[str], echo: bool = True, show_progress: bool = True,
               run_root: str | os.PathLike[str] | None = None, baselines: bool | None = None,
               on_started=None) -> dict:
    """Run a whole PS job here; returns the summary (also written to ``summary.json``).

    ``on_started(supervisor, layout)`` is called once every process runs (fault tests use it
    to kill a worker). Ctrl-C / SIGTERM stop every process and exit 130 / 143.
    """
    job_path = Path(job_path).resolve()
    if not Path(spec.entrypoint).is_file():
        raise LaunchError(f"entrypoint {spec.entrypoint!r} not found (relative paths start at {Path.cwd()})",
                          hint="fix entrypoint in the job file, or run from the folder it is relative to")
    run_dir = new_run_dir(spec, run_root)
    layout = prepare_security(spec, run_dir)
    collector = MetricsCollector(run_dir / "metrics.jsonl")
    started = time.monotonic()
    with Supervisor(run_dir, echo=echo, on_line=collector.on_line) as sup:
        def body() -> dict:
            for i in range(spec.ps.shards):
                sup.start(shard_process(spec, job_path, layout, i))
            layout.shard_addresses = _wait_for_ports(layout, spec.ps.shards, sup)
            procs = worker_processes(spec, job_path, layout)
            if spec.train.site_baselines if baselines is None else baselines:
                procs += baseline_processes(spec, job_path, layout)
            for p in procs:
                sup.start(p)
            log.info("job_started", job=spec.name, run_dir=str(run_dir), shards=layout.shard_addresses,
                     workers=spec.num_workers)
            if on_started is not None:
                on_started(sup, layout)
            progress, probe = _progress_fn(spec, layout, collector) if show_progress else (None, None)
            try:
                codes = sup.wait([p.name for p in procs], progress=progress)
            finally:
                if probe is not None:
                    probe.close()
            codes.update(sup.stop(grace_s=5.0))
            return codes

        codes = run_supervised(sup, body)
    collector.close()
    summary = summarize(spec, layout, collector, codes, sup, time.monotonic() - started)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("job_finished", job=spec.name, status=summary["status"], test_accuracy=summary["test_accuracy"])
    return summary
