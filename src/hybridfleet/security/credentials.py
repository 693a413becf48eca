"""The credential model: what each worker of a job holds, issued in one place.

Every worker gets its own token (role ``worker``) naming the job, its site and its
worker id ``<site>-<site_rank>`` (claim ``wid``), with a fresh ``jti``. A shard binds
every request to that id: Join, Heartbeat, Leave, Push and Pull naming another worker
are refused, and the worker id must be one the job defines (``site_rank`` below the
site's ``workers``). With mutual TLS each site also gets its own client certificate
whose common name is the site; a shard refuses a token whose site differs from the
certificate's. `issue_site_credentials` is the one function that issues them: `hfleet
run` calls it for local jobs and the Kubernetes renderer calls it per site Secret, so
the two cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from hybridfleet.security.certs import CertKeyPair, Pki
from hybridfleet.security.tokens import WORKER_ROLE, TokenIssuer, unverified_claims



@dataclass(frozen=True)
class WorkerCredential:
    """One worker's bearer token and what it is bound to."""

    worker_id: str
    site: str
    token: str
    token_id: str
    expires_at: dt.datetime


@dataclass(frozen=True)
class SiteCredentials:
    """Everything one site's workers need to reach the shards (one Kubernetes Secret's worth)."""

    site: str
    workers: dict[str, WorkerCredential]   # worker id -> credential, in site-rank order
    client_cert: CertKeyPair | None        # mutual TLS: this site's certificate (CN = site), else None


def worker_id(site: str, site_rank: int) -> str:
    """The worker id a shard expects from worker ``site_rank`` of ``site``."""
    return f"{site}-{site_rank}"


def initialising_worker(job) -> str:
    """The one worker whose values initialise the shards: site rank 0 of ``ps.init_site``, else
    global rank 0 (site rank 0 of the first site; global ranks follow the order of ``sites``)."""
    return worker_id(job.ps.init_site or next(iter(job.sites)), 0)


def site_worker_ids(job, site: str) -> list[str]:
    """Every worker id ``job`` defines for ``site`` (a `hybridfleet.spec.models.JobSpec`)."""
    if site not in job.sites:
        raise ValueError(f"site {site!r} is not in job {job.name!r} ({', '.join(job.sites)})")
    return [worker_id(site, r) for r in range(job.sites[site].workers)]


def parse_worker_id(job, worker: str) -> tuple[str, int] | None:
    """``(site, site_rank)`` when ``worker`` is one of ``job``'s worker ids, else None."""
    site, sep, rank = worker.rpartition("-")
    if not sep or site not in job.sites or not rank.isdigit() or rank != str(int(rank)):
        return None
    return (site, int(rank)) if int(rank) < job.sites[site].workers else None


def issue_site_credentials(job, site: str, issuer: TokenIssuer, pki: Pki | None = None,
                           ttl_s: float | None = None) -> SiteCredentials:
    """One token per worker of ``site`` (bound to its worker id, ``ttl_s`` default: the job's
    ``security.token_ttl_s``) and, when ``pki`` holds a client certificate named after the
    site, that certificate for mutual TLS. Raises ValueError for a site the job lacks, and
    `hybridfleet.errors.AuthError` when the job asks for mutual TLS and ``pki`` has no
    certificate for the site."""
    from hybridfleet.errors import AuthError

    ids = site_worker_ids(job, site)
    ttl = float(ttl_s if ttl_s is not None else job.security.token_ttl_s)
    workers = {}
    for wid in ids:
        token = issuer.issue(job.name, site, WORKER_ROLE, ttl, subject=f"{site}/{wid}", worker=wid)
        claims = unverified_claims(token)
        workers[wid] = WorkerCredential(wid, site, token, claims["jti"],
                                        dt.datetime.fromtimestamp(claims["exp"], dt.timezone.utc))
    cert = pki.clients.get(site) if pki is not None else None
    if job.security.mutual_tls and pki is not None and cert is None:
        raise AuthError(f"mutual TLS: {pki.directory} has no client certificate for site {site!r} "
                        f"(create it with `hfleet certs init DIR --client {site}`)")
    return SiteCredentials(site, workers, cert)


def issue_admin_token(job, issuer: TokenIssuer, ttl_s: float | None = None) -> str:
    """A token of role ``admin`` for ``job``: it may read a shard's Status, nothing else."""
    return issuer.issue(job.name, "-", "admin", float(ttl_s if ttl_s is not None else job.security.token_ttl_s),
                        subject="hfleet-run")
