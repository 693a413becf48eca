"""`hfleet run` for parameter-server jobs: shards, workers and site baselines on this machine.

The run directory ``<run_dir>/<name>/<timestamp>/`` receives ``logs/`` (one file
per process), ``events.jsonl`` (starts, exits, restarts), ``metrics.jsonl``
(every ``metrics`` record the workers log), ``certs/`` (the job's dev CA, server
certificate, one client certificate per site and the token-signing key, when
security is on), ``credentials/`` (one token file per worker, renewed at half the
token lifetime while the job runs) and ``summary.json``; ``run.json`` (job, pid, start time) is written first, so a run
without ``summary.json`` is live while that pid runs and crashed otherwise. With
metrics on, every process serves ``/metrics`` on a port it binds itself, writes it under
``metrics-ports/``, and ``prometheus/targets.json`` lists them for Prometheus (file-based
service discovery, `hybridfleet.launch.targets`);
``report.html`` is written at the end.
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
from hybridfleet.launch.reshard import reshard_for_resume
from hybridfleet.launch.scale import supervised_watcher
from hybridfleet.launch.run_summary import summarize
from hybridfleet.launch.run_view import RunProgress
from hybridfleet.launch.supervisor import ProcessSpec, Supervisor, run_supervised
from hybridfleet.launch.targets import RunTargets
from hybridfleet.obs.discovery import Target, retire_targets, write_scrape_config
from hybridfleet.obs.log import get_logger, redirect_log
from hybridfleet.obs.runinfo import JOB_COPY
from hybridfleet.ps.worker.resolve import PORT_DIR_ENV, port_file
from hybridfleet.ps.worker.site import HUB_FILE_ENV
from hybridfleet.spec.models import JobSpec
from hybridfleet.spec.preflight import check_here
from hybridfleet.spec.resolved import resolved_job

log = get_logger("run")

SHARD_START_TIMEOUT_S = 60.0


@dataclass
class RunLayout:
    """Paths and credentials of one run."""

    run_dir: Path
    certs_dir: Path | None
    tokens: dict[str, str] = field(default_factory=dict)   # worker id (or "admin") -> token
    shard_addresses: list[str] = field(default_factory=list)
    resume_from: Path | None = None  # an earlier run whose shard snapshots this run continues (--resume)

    def token_file(self, worker_id: str) -> Path:
        """Where worker ``worker_id``'s current token is kept (renewed in place)."""
        return self.run_dir / "credentials" / f"{worker_id}.token"


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
    """Make the job's dev CA, certificates (one client certificate per site) and signing key, and
    one token per worker (see `hybridfleet.security.credentials`) plus an admin token for Status."""
    layout = RunLayout(run_dir=run_dir, certs_dir=None)
    if spec.security.tls == "off" and spec.security.tokens == "off":
        return layout
    from hybridfleet.security import generate_signing_key, make_dev_pki
    from hybridfleet.security.tokens import SIGNING_KEY

    certs = run_dir / "certs"
    if spec.security.tls not in ("auto", "off"):
        certs = Path(spec.security.tls)
    else:
        make_dev_pki(certs, hosts=sorted({spec.ps.host, "127.0.0.1", "localhost"}), clients=list(spec.sites))
    layout.certs_dir = certs
    if spec.security.tls != "off":
        from hybridfleet.security import load_pki
        from hybridfleet.security.certs import issue_hub_certificate

        pki = load_pki(certs)
        for site, s in spec.sites.items():
            if s.aggregate and s.workers > 1:
                issue_hub_certificate(pki, site)  # the site leader serves its followers with it
    if spec.security.tokens == "auto":
        if not (certs / SIGNING_KEY).exists():
            generate_signing_key(certs)
        issue_tokens(spec, layout)
    return layout


def issue_tokens(spec: JobSpec, layout: RunLayout) -> None:
    """(Re-)issue every worker's token and the admin token; each worker's token file is replaced
    atomically, so a running worker picks up the new token on its next call."""
    from hybridfleet.security import TokenIssuer
    from hybridfleet.security.certs import KEY_FILE_MODE, write_file_atomic
    from hybridfleet.security.credentials import issue_admin_token, issue_site_credentials

    issuer = TokenIssuer.from_dir(layout.certs_dir)
    (layout.run_dir / "credentials").mkdir(mode=0o700, exist_ok=True)
    for site in spec.sites:
        for wid, cred in issue_site_credentials(spec, site, issuer).workers.items():
            layout.tokens[wid] = cred.token
            write_file_atomic(layout.token_file(wid), cred.token.encode(), KEY_FILE_MODE)
    layout.tokens["admin"] = issue_admin_token(spec, issuer)


class TokenRenewer:
    """Re-issues the job's tokens every half lifetime while the job runs (long jobs outlive one token)."""

    def __init__(self, spec: JobSpec, layout: RunLayout):
        self.spec, self.layout = spec, layout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="token-renewer", daemon=True)

    def start(self) -> "TokenRenewer":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.spec.security.token_ttl_s / 2):
            try:
                issue_tokens(self.spec, self.layout)
                log.info("tokens_renewed", workers=len(self.layout.tokens) - 1)
            except OSError as err:
                log.error("token_renewal_failed", error=str(err))

    def stop(self) -> None:
        self._stop.set()


def ps_clients(spec: JobSpec) -> int:
    """How many workers talk to the shards: one leader per aggregating site, every worker elsewhere."""
    return sum(1 if s.aggregate and s.workers > 1 else s.workers for s in spec.sites.values())


def snapshot_store(spec: JobSpec, run_dir: Path) -> str:
    """Where the shards of the run in ``run_dir`` keep their snapshots: ``<checkpoint.store>/<job>/<run>``
    when the job file names a store, else ``<run_dir>/snapshots``.

    Keyed by job and run, so a new run never restores another run's shards by accident; only
    ``hfleet run --resume RUN_DIR`` points a run at an earlier run's snapshots.
    """
    if "store" in spec.checkpoint.model_fields_set:
        return f"{spec.checkpoint.store.rstrip('/')}/{spec.name}/{run_dir.name}"
    return f"file://{run_dir.resolve() / 'snapshots'}"


def resolve_resume(spec: JobSpec, resume: str, run_root: str | os.PathLike[str] | None = None) -> Path:
    """The run directory ``--resume`` names: a path, or ``latest`` (the newest run of this job that has
    a summary or logs). LaunchError when there is none or it belongs to another job."""
    base = Path(run_root or spec.run_dir) / spec.name
    if resume == "latest":
        runs = sorted((p for p in base.glob("*") if p.is_dir() and (p / "run.json").is_file()),
                      key=lambda p: p.stat().st_mtime)
        if not runs:
            raise LaunchError(f"--resume latest: no earlier run of job {spec.name} under {base}",
                              hint="start it without --resume, or name the run directory to continue")
        return runs[-1].resolve()
    path = Path(resume)
    if not (path / "run.json").is_file():
        raise LaunchError(f"--resume {resume}: not a run directory (no run.json there)",
                          hint=f"name a folder under {base}, or use --resume latest")
    try:
        job = json.loads((path / "run.json").read_text()).get("job")
    except (OSError, ValueError) as err:
        raise LaunchError(f"--resume {resume}: its run.json cannot be read ({err})",
                          hint="name another run directory, or start without --resume") from err
    if job != spec.name:
        raise LaunchError(f"--resume {resume}: that run is of job {job!r}, not {spec.name!r}",
                          hint="resume a run of the same job, or start without --resume")
    return path.resolve()


def model_root(run_dir: Path) -> Path:
    """Where the run's model checkpoints and MODEL.json go (see `hybridfleet.ckpt.run_model`)."""
    return run_dir.resolve() / "model"


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
            "--port-file", str(port_file(layout.run_dir, shard)),
            "--expected-workers", str(ps_clients(spec)),
            "--snapshot-store", snapshot_store(spec, layout.resume_from or layout.run_dir)]
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
        env[PORT_DIR_ENV] = str(layout.run_dir)  # shard-<i>.port: a replaced shard's new address
        env["HFLEET_MODEL_DIR"] = str(model_root(layout.run_dir))
        if spec.security.tls == "off":
            env["HFLEET_INSECURE"] = "1"
        elif layout.certs_dir is not None:
            from hybridfleet.security import load_pki

            pki = load_pki(layout.certs_dir)
            env["HFLEET_CA_CERT"] = str(pki.ca_cert)
            if spec.security.mutual_tls:
                if site not in pki.clients:
                    raise LaunchError(f"mutual TLS: {layout.certs_dir} has no client certificate for site {site!r} "
                                      f"(create it with `hfleet certs init DIR --client {site}`)")
                env["HFLEET_CLIENT_CERT"] = str(pki.clients[site].cert)
                env["HFLEET_CLIENT_KEY"] = str(pki.clients[site].key)
        wid = f"{site}-{site_rank}"
        if wid in layout.tokens:
            env["HFLEET_TOKEN_FILE"] = str(layout.token_file(wid))
    return env


def worker_processes(spec: JobSpec, job_path: Path, layout: RunLayout) -> list[ProcessSpec]:
    """One process per worker of every site; global ranks follow the order of ``sites``."""
    procs, rank = [], 0
    for site, s in spec.sites.items():
        entry = str(Path(spec.site_entrypoint(site)))
        # the leader binds a free port and writes it to the hub file; its followers read it there
        hub = ({"HFLEET_SITE_HUB": "127.0.0.1:0", HUB_FILE_ENV: str(layout.run_dir / "site-hubs" / f"{site}.port")}
               if s.aggregate and s.workers > 1 else {})
        for site_rank in range(s.workers):
            prefix = ["ip", "netns", "exec", s.netns] if s.netns else []
            procs.append(ProcessSpec(name=f"worker-{site}-{site_rank}",
                                     argv=[*prefix, sys.executable, entry, *spec.args],
                                     env={**worker_env(spec, job_path, layout, site, rank, site_rank), **hub},
                                     max_restarts=spec.max_restarts, role="worker"))
            if hub and site_rank == 0:
                procs[-1].env.update(site_hub_env(spec, layout, site))
            rank += 1
    return procs


def site_hub_env(spec: JobSpec, layout: RunLayout, site: str) -> dict[str, str]:
    """What the leader of an aggregating site needs to admit only its site's workers: the hub's
    certificate (TLS on) and the job's token-verifying public key (tokens on)."""
    from hybridfleet.ps.worker.site_security import HUB_CERT_ENV, HUB_KEY_ENV, VERIFY_KEY_ENV
    from hybridfleet.security.certs import hub_certificate_paths
    from hybridfleet.security.tokens import VERIFY_KEY

    env = {}
    if layout.certs_dir is None:
        return env
    if spec.security.tls != "off":
        pair = hub_certificate_paths(layout.certs_dir, site)
        env.update({HUB_CERT_ENV: str(pair.cert), HUB_KEY_ENV: str(pair.key)})
    if spec.security.tokens != "off":
        env[VERIFY_KEY_ENV] = str(layout.certs_dir / VERIFY_KEY)
    return env


def baseline_processes(spec: JobSpec, job_path: Path, layout: RunLayout) -> list[ProcessSpec]:
    """Each site training alone on its own data (no servers), for comparison."""
    return [ProcessSpec(name=f"baseline-{site}", argv=[sys.executable, str(spec.site_entrypoint(site)), *spec.args],
                        env=worker_env(spec, job_path, layout, site, 0, 0, with_servers=False), role="baseline")
            for site in spec.sites]


def write_run_info(spec: JobSpec, run_dir: Path, resume_from: Path | None = None) -> None:
    """``run.json``: what runs here and which pid supervises it (read by `hfleet report` and `hfleet ui`), and
    ``job.json``: the resolved job as it runs, secrets redacted (`hybridfleet.spec.resolved`)."""
    info = {"job": spec.name, "framework": spec.framework, "sync": spec.ps.sync, "pid": os.getpid(),
            "started": time.time(), "steps": spec.train.steps, "sites": list(spec.sites),
            "resumed_from": str(resume_from) if resume_from else None}
    (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    (run_dir / JOB_COPY).write_text(json.dumps(resolved_job(spec), indent=2) + "\n")


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
    files = [port_file(layout.run_dir, i) for i in range(num_shards)]
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


def finish_model(spec: JobSpec, run_dir: Path, summary: dict) -> dict | None:
    """Write the run's MODEL.json (final + best checkpoint, lineage) and publish it per ``registry:``.

    Returns what summary.json records under ``model`` (None when no worker saved a model).
    """
    from hybridfleet.ckpt.run_model import run_lineage, write_model_card

    root = model_root(run_dir)
    if not root.is_dir():
        return None
    card = write_model_card(str(root), run_lineage(spec, run_dir, summary), spec.checkpoint.keep_best)
    if card is None:
        return None
    out = {"url": card["url"], "final_step": card["final"]["step"],
           "best_step": card["best"]["step"] if card["best"] else None, "registered": None}
    if spec.registry.publish_as and summary["status"] == "failed":
        out["registered"] = {"message": "not published: the run failed"}
    elif spec.registry.publish_as:
        from hybridfleet.registry.publish import publish_run

        out["registered"] = publish_run(spec, card)
    return out


def run_ps_job(spec: JobSpec, job_path: str | os.PathLike[str], echo: bool = True, show_progress: bool = True,
               run_root: str | os.PathLike[str] | None = None, baselines: bool | None = None,
               on_started=None, metrics: bool = True, report: bool = True, stream=None,
               log_to_file: bool = False, egress_scan: bool = False, resume_from: Path | None = None) -> dict:
    """Run a whole PS job here; returns the summary (also written to ``summary.json``).

    ``echo`` copies every process's log lines to stderr (they always go to ``logs/``);
    ``show_progress`` shows the live view (`hybridfleet.obs.live`) on ``stream``
    (default stderr); ``metrics`` serves Prometheus metrics from every process;
    ``report`` writes ``report.html`` at the end (its path is ``summary["report"]``);
    ``log_to_file`` sends this process's JSON-lines log to ``RUN_DIR/hfleet-run.log``
    instead of stderr while the job runs; ``egress_scan``: every worker keeps what it
    sends under ``run_dir/egress/`` and searches it for its own training rows at the end
    (`hybridfleet.ps.worker.egress`); summary.json then has ``egress_scan`` per site.
    ``on_started(supervisor, layout)`` is called once every process runs (fault tests use it
    to kill a worker). ``resume_from`` (see `resolve_resume`): the shards restore that earlier
    run's snapshots instead of starting fresh. Ctrl-C / SIGTERM stop every process and exit 130 / 143.
    """
    job_path = Path(job_path).resolve()
    check_here(spec)  # entrypoints, their frameworks, local site data, the extras blocks need
    run_dir = new_run_dir(spec, run_root)
    write_run_info(spec, run_dir, resume_from)
    if log_to_file:
        with (run_dir / "hfleet-run.log").open("a") as sink, redirect_log(sink):
            return _run(spec, job_path, run_dir, echo, show_progress, baselines, on_started, metrics, report, stream,
                        egress_scan, resume_from)
    return _run(spec, job_path, run_dir, echo, show_progress, baselines, on_started, metrics, report, stream,
                egress_scan, resume_from)


def _run(spec: JobSpec, job_path: Path, run_dir: Path, echo: bool, show_progress: bool, baselines: bool | None,
         on_started, metrics: bool, report: bool, stream, egress_scan: bool = False,
         resume_from: Path | None = None) -> dict:
    layout = prepare_security(spec, run_dir)
    layout.resume_from = resume_from
    collector = MetricsCollector(run_dir / "metrics.jsonl")
    renewer = TokenRenewer(spec, layout).start() if layout.tokens else None
    started = time.monotonic()
    exporter = None
    targets: list[Target] = []
    run_targets = None
    if metrics:
        from hybridfleet.obs.metrics import serve_metrics

        exporter = serve_metrics(0)
        targets.append(Target(f"127.0.0.1:{exporter.server_port}",
                              {"job": spec.name, "role": "supervisor", "process": "hfleet-run"}))
        run_targets = RunTargets(spec.name, run_dir, targets).start()
    with Supervisor(run_dir, echo=echo, on_line=collector.on_line) as sup, \
            RunProgress(spec, layout, targets, lambda: list(sup.events),
                        stream, enabled=show_progress) as progress:
        def start_all(procs: list[ProcessSpec]) -> None:
            if run_targets is not None:
                run_targets.attach(procs)
            for p in procs:
                sup.start(p)

        def body() -> dict:
            progress.phase(f"starting {spec.ps.shards} shard{'s' if spec.ps.shards > 1 else ''}")
            if metrics:
                write_scrape_config(run_dir, run_dir.parent.parent)
            if layout.resume_from is not None:  # snapshots of another shard count are re-cut first
                reshard_for_resume(spec, snapshot_store(spec, layout.resume_from))
            start_all([shard_process(spec, job_path, layout, i) for i in range(spec.ps.shards)])
            layout.shard_addresses = _wait_for_ports(layout, spec.ps.shards, sup)
            procs = worker_processes(spec, job_path, layout)
            if egress_scan:
                from hybridfleet.ps.worker.egress import CAPTURE_ENV

                for p in procs:
                    p.env[CAPTURE_ENV] = str(run_dir / "egress" / f"{p.name}.bin")
            if spec.train.site_baselines if baselines is None else baselines:
                procs += baseline_processes(spec, job_path, layout)
            progress.phase("workers joining", f"0/{ps_clients(spec)}")
            start_all(procs)
            log.info("job_started", job=spec.name, run_dir=str(run_dir), shards=layout.shard_addresses,
                     workers=spec.num_workers)
            watcher = supervised_watcher(spec, job_path, layout, sup, start_all).start()  # `hfleet ps scale`
            try:
                if on_started is not None:
                    on_started(sup, layout)
                codes = progress.wait(sup, [p.name for p in procs])
            finally:
                watcher.stop()
            progress.phase("stopping shards")
            codes.update(sup.stop(grace_s=5.0))
            return codes

        try:
            codes = run_supervised(sup, body)
        finally:
            if renewer is not None:
                renewer.stop()
            if run_targets is not None:
                run_targets.stop()
                retire_targets(run_dir)
            if exporter is not None:
                exporter.shutdown()
                exporter.server_close()
        collector.close()
        summary = summarize(spec, layout, collector, codes, sup, time.monotonic() - started)
        progress.phase("saving the model" + (" and publishing" if spec.registry.publish_as else ""))
        summary["model"] = finish_model(spec, run_dir, summary)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if report:  # after summary.json, so the report shows the run as finished
            progress.phase("writing the report")
            summary["report"] = str(_write_report(run_dir))
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        progress.show_final(summary)
    log.info("job_finished", job=spec.name, status=summary["status"], test_accuracy=summary["test_accuracy"])
    return summary


def _write_report(run_dir: Path) -> Path:
    from hybridfleet.obs.report import write_report

    return write_report(run_dir)
