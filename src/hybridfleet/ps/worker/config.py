"""Where a worker sits and how it reaches the shards, read from the ``HFLEET_*`` variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.egress import CAPTURE_ENV
from hybridfleet.ps.worker.resolve import PORT_DIR_ENV
from hybridfleet.ps.worker.site import HUB_FILE_ENV
from hybridfleet.spec.models import JobSpec


@dataclass
class WorkerConfig:
    """Where this worker sits and how it reaches the shards (read from ``HFLEET_*`` variables)."""

    job: JobSpec
    site: str = "local"
    rank: int = 0
    site_rank: int = 0
    servers: list[str] = field(default_factory=list)
    security: ClientSecurity = field(default_factory=lambda: ClientSecurity(insecure=True))
    site_hub: str | None = None   # host:port of the site leader when the site aggregates
    site_hub_file: str | None = None  # with port 0 in site_hub: the leader writes the port it bound here
    egress_capture: str | None = None  # test mode: keep every sent byte here (see hybridfleet.ps.worker.egress)
    shard_port_dir: str | None = None  # where shard-<i>.port files name each shard's address (replacements)

    @property
    def aggregates(self) -> bool:
        """Whether this worker reduces with its site first (only the site leader talks to the shards)."""
        return bool(self.site_hub and self.servers and self.job.sites[self.site].workers > 1)

    @property
    def worker_id(self) -> str:
        return f"{self.site}-{self.site_rank}"

    @property
    def initialises(self) -> bool:
        """Whether this worker pushes the initial values: the first worker of ``ps.init_site`` (default: rank 0),
        the one worker whose INIT the shards accept."""
        from hybridfleet.security.credentials import initialising_worker

        return self.worker_id == initialising_worker(self.job)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "WorkerConfig":
        """Build the config from ``HFLEET_JOB``, ``HFLEET_SITE``, ``HFLEET_RANK``, ``HFLEET_SERVERS``, ..."""
        from hybridfleet.spec import load_spec

        env = dict(os.environ if env is None else env)
        job_path = env.get("HFLEET_JOB")
        if not job_path:
            raise ValueError("HFLEET_JOB is not set: run the script with `hfleet run JOB` or `hfleet worker JOB ...`")
        job = load_spec(job_path)
        servers = [s for s in env.get("HFLEET_SERVERS", "").split(",") if s]
        site = env.get("HFLEET_SITE", next(iter(job.sites)))
        if site not in job.sites:
            raise ValueError(f"HFLEET_SITE={site!r} is not a site of job {job.name!r} ({', '.join(job.sites)})")
        return cls(job=job, site=site, rank=int(env.get("HFLEET_RANK", "0")),
                   site_rank=int(env.get("HFLEET_SITE_RANK", "0")), servers=servers,
                   security=client_security_from_env(env), site_hub=env.get("HFLEET_SITE_HUB") or None,
                   site_hub_file=env.get(HUB_FILE_ENV) or None,
                   egress_capture=env.get(CAPTURE_ENV) or None, shard_port_dir=env.get(PORT_DIR_ENV) or None)


def client_security_from_env(env: dict[str, str]) -> ClientSecurity:
    """TLS + token from ``HFLEET_CA_CERT``/``HFLEET_CLIENT_CERT``/``HFLEET_CLIENT_KEY``/``HFLEET_TOKEN``
    (or ``HFLEET_TOKEN_FILE``, re-read when it changes);
    plaintext only with ``HFLEET_INSECURE=1``."""
    token, token_file = env.get("HFLEET_TOKEN") or None, env.get("HFLEET_TOKEN_FILE") or None
    if env.get("HFLEET_INSECURE") == "1":
        return ClientSecurity(insecure=True, token=token, token_file=token_file)
    ca = env.get("HFLEET_CA_CERT")
    if not ca:
        return ClientSecurity(insecure=False, token=token, token_file=token_file)
    cert, key = env.get("HFLEET_CLIENT_CERT"), env.get("HFLEET_CLIENT_KEY")
    return ClientSecurity.from_files(ca, cert or None, key or None, token=token, token_file=token_file)
