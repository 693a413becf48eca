"""Start one shard from a job spec: security from a certificate directory, or explicitly none."""

from __future__ import annotations

from pathlib import Path

from hybridfleet.ps.server.service import ServerSecurity, ShardServer, method_roles
from hybridfleet.ps.server.shard import ShardState
from hybridfleet.security.credentials import initialising_worker
from hybridfleet.errors import UsageError
from hybridfleet.spec.models import JobSpec


def server_security(job: JobSpec, certs_dir: str | Path | None, insecure_plaintext: bool = False,
                    no_auth: bool = False) -> ServerSecurity:
    """TLS (mutual when the job asks) and token checks from ``certs_dir``; each may only be
    switched off explicitly."""
    creds, interceptors, ssl_context, verifier = None, (), None, None
    if not insecure_plaintext or not no_auth:
        if certs_dir is None:
            raise UsageError("--certs DIR is required: the shard serves TLS and checks tokens",
                             hint="make one with `hfleet certs init DIR --host <this machine's name>` and pass "
                                  "--certs DIR (or, explicitly, both --insecure-plaintext and --no-auth)")
    if not insecure_plaintext:
        from hybridfleet.security import load_pki, server_credentials

        from hybridfleet.ps.server.bulk_server import server_ssl_context

        pki = load_pki(certs_dir)
        creds = server_credentials(pki, mutual_tls=job.security.mutual_tls)
        ssl_context = server_ssl_context(str(pki.server_cert), str(pki.server_key),
                                         str(pki.ca_cert) if job.security.mutual_tls else None)
    if not no_auth:
        from hybridfleet.security import AuthInterceptor, TokenVerifier

        verifier = TokenVerifier.from_dir(certs_dir, job=job.name)
        interceptors = (AuthInterceptor(verifier, method_roles()),)
    return ServerSecurity(server_credentials=creds, interceptors=interceptors, insecure=insecure_plaintext,
                          ssl_context=ssl_context, verifier=verifier)


def start_shard(job: JobSpec, shard: int, host: str, port: int, security: ServerSecurity,
                expected_workers: int = 0, snapshot_store: str | None = None, bulk_port: int = 0) -> ShardServer:
    """Create the shard's state (restored from its newest snapshot when the job snapshots) and serve it;
    returns the running server (``.port`` is the bound port, ``.bulk`` the bulk data plane or None,
    ``.snapshotter`` the snapshotter or None). ``bulk_port`` 0 takes any free port."""
    if not 0 <= shard < job.ps.shards:
        raise UsageError(f"--shard: must be in 0..{job.ps.shards - 1} for a job of {job.ps.shards} shard(s) (got {shard})",
                         hint=f"pass --shard 0..{job.ps.shards - 1}, or change ps.shards in the job file")
    secagg = None
    if job.ps.secure_aggregation is not None:
        from hybridfleet.ps.secagg.settings import SecAggSettings

        secagg = SecAggSettings.resolve(job.ps, job.sites)
    state = ShardState(shard, job.ps, flavour=job.framework, expected_workers=expected_workers,
                       sites={name: site.workers for name, site in job.sites.items()}, secagg=secagg,
                       initialiser=initialising_worker(job))
    snapshotter = None
    if job.ps.snapshot_every_steps or job.ps.snapshot_every_s:
        from hybridfleet.ps.server.snapshot import Snapshotter, snapshot_url

        url = snapshot_url(snapshot_store or job.checkpoint.store, shard)
        snapshotter = Snapshotter(state, url, job.ps.snapshot_every_steps, job.ps.snapshot_every_s,
                                  job.checkpoint.keep_last)
        snapshotter.restore_newest()
    bulk = None if job.ps.transport == "grpc" else bulk_port
    server = ShardServer(state, host, port, security, job.ps.max_push_bytes, bulk_port=bulk,
                         num_workers=job.num_workers).start()
    server.snapshotter = snapshotter.start() if snapshotter else None
    return server
