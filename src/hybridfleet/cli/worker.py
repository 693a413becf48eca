"""`hfleet worker`: run one worker of a job against shards on other machines."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from hybridfleet.errors import UsageError
from hybridfleet.spec import load_spec


def worker(
    job: str = typer.Argument(..., help="the job file"),
    site: str = typer.Option(..., help="this worker's site (a key of `sites`)"),
    site_rank: int = typer.Option(0, help="rank within the site (which part of the site's data)"),
    rank: Optional[int] = typer.Option(None, help="global worker rank (0 initialises the shards); "
                                                  "default: the workers of earlier sites + --site-rank"),
    servers: str = typer.Option(..., help="shard addresses host:port,... in shard order"),
    certs: Optional[Path] = typer.Option(None, help="directory holding the CA (and client) certificates"),
    token: Optional[str] = typer.Option(None, envvar="HFLEET_TOKEN", help="bearer token of this worker"),
    token_file: Optional[Path] = typer.Option(None, envvar="HFLEET_TOKEN_FILE",
                                              help="file holding this worker's token, re-read when it changes "
                                                   "(renewal); wins over --token"),
    retry_s: float = typer.Option(60.0, "--retry-s", help="how long to keep retrying a shard that does not answer"),
    insecure_plaintext: bool = typer.Option(False, "--insecure-plaintext",
                                            help="dial the shards without TLS (only for shards served with --insecure-plaintext)"),
) -> None:
    """Run the job's entrypoint as one worker; it reaches the shards at SERVERS."""
    spec = load_spec(job)
    if site not in spec.sites:
        raise typer.BadParameter(f"site {site!r} is not in the job ({', '.join(spec.sites)})", param_hint="--site")
    if not 0 <= site_rank < spec.sites[site].workers:
        raise typer.BadParameter(f"must be in 0..{spec.sites[site].workers - 1} for site {site!r} (got {site_rank})",
                                 param_hint="--site-rank")
    addresses = [s for s in servers.split(",") if s.strip()]
    if len(addresses) != spec.ps.shards:
        raise UsageError(f"--servers lists {len(addresses)} address(es) but job {spec.name!r} has ps.shards: {spec.ps.shards}",
                         hint=f"give all {spec.ps.shards} shard addresses host:port, comma-separated, in shard order")
    if certs is None and not insecure_plaintext:
        raise UsageError("--certs DIR is required: workers check the shards' TLS certificates",
                         hint="pass --certs DIR with the job's CA (from `hfleet certs init`), or --insecure-plaintext "
                              "for shards served without TLS")
    if not token and token_file is None and spec.security.tokens != "off" and not insecure_plaintext:
        raise UsageError(f"a token is required: job {spec.name!r} has security.tokens: {spec.security.tokens}",
                         hint=f"pass --token or --token-file (or set HFLEET_TOKEN / HFLEET_TOKEN_FILE); make one with "
                              f"`hfleet certs token DIR --job {spec.name} --site {site} --role worker "
                              f"--worker {site}-{site_rank}`")
    if rank is None:
        names = list(spec.sites)
        rank = sum(spec.sites[s].workers for s in names[:names.index(site)]) + site_rank
    env = dict(os.environ, HFLEET_JOB=str(Path(job).resolve()), HFLEET_SITE=site, HFLEET_RANK=str(rank),
               HFLEET_SITE_RANK=str(site_rank), HFLEET_SERVERS=servers, HFLEET_SHARD_RETRY_S=str(retry_s))
    if token:
        env["HFLEET_TOKEN"] = token
    if token_file is not None:
        env["HFLEET_TOKEN_FILE"] = str(token_file.resolve())
    if insecure_plaintext:
        env["HFLEET_INSECURE"] = "1"
    elif certs is not None:
        env.update(_client_tls_files(certs, site, spec.security.mutual_tls))
    if certs is not None and site_rank == 0:
        env.update(_hub_files(certs, site))
    os.execve(sys.executable, [sys.executable, spec.site_entrypoint(site), *spec.args], env)


def _client_tls_files(certs: Path, site: str, mutual_tls: bool) -> dict[str, str]:
    """``HFLEET_CA_CERT`` (and the site's client certificate under mutual TLS) from a certs directory.

    A worker needs only ``ca.pem`` (plus ``client-<site>.pem``/``.key`` with mutual TLS, whose
    common name the shards check against the token's site): never the shards' server key.
    """
    from hybridfleet.errors import AuthError
    from hybridfleet.security.certs import CA_CERT, CLIENT_PREFIX

    ca = certs / CA_CERT
    if not ca.is_file():
        raise AuthError(f"--certs {certs}: no {CA_CERT}; copy the CA certificate from `hfleet certs init` there")
    files = {"HFLEET_CA_CERT": str(ca)}
    if not mutual_tls:
        return files
    for name in (site,):
        cert, key = certs / f"{CLIENT_PREFIX}{name}.pem", certs / f"{CLIENT_PREFIX}{name}.key"
        if cert.is_file() and key.is_file():
            return {**files, "HFLEET_CLIENT_CERT": str(cert), "HFLEET_CLIENT_KEY": str(key)}
    raise AuthError(f"--certs {certs}: the job uses mutual TLS but holds no {CLIENT_PREFIX}{site}.pem/.key; "
                    f"make one with `hfleet certs init DIR --client {site}`")


def _hub_files(certs: Path, site: str) -> dict[str, str]:
    """What a site's leader needs to run its site hub, where the certs directory holds it: the hub
    certificate (`hfleet certs hub`) and the job's token-verifying public key."""
    from hybridfleet.ps.worker.site_security import HUB_CERT_ENV, HUB_KEY_ENV, VERIFY_KEY_ENV
    from hybridfleet.security.certs import hub_certificate_paths
    from hybridfleet.security.tokens import VERIFY_KEY

    env = {}
    pair = hub_certificate_paths(certs, site)
    if pair.cert.is_file() and pair.key.is_file():
        env.update({HUB_CERT_ENV: str(pair.cert.resolve()), HUB_KEY_ENV: str(pair.key.resolve())})
    if (certs / VERIFY_KEY).is_file():
        env[VERIFY_KEY_ENV] = str((certs / VERIFY_KEY).resolve())
    return env


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
