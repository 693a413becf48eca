"""What each rendered pod may hold: one Secret for the shards, one per worker.

Shards hold the CA certificate, the server certificate with its key and the token
verification key. A worker's Secret holds the CA certificate, that worker's token alone
(``worker-token-<site>-<rank>``, bound to its worker id) and, with mutual TLS, its site's
client certificate (``client-<site>.pem``); never the server key, never another worker's
token, never another site's credentials. Kubernetes mounts a Secret whole and a pod
template cannot choose its volume by an index, so each worker is its own Job mounting its
own Secret (`hybridfleet.k8s.ps.worker_jobs`). The plain-host bundle of a site holds every
token of the site (`secret_files` without a rank). The file names are those `hfleet certs init` writes, so a Secret
mounted at ``/etc/hfleet/certs`` is a directory `--certs` reads as it is.

`secret_files` is the one place that decides a role's files; `credential_secret` turns
them into a Secret with real values from a certs directory, or with explicit
placeholders when the caller asked for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridfleet.errors import AuthError, UsageError
from hybridfleet.k8s.common import Manifest, dns_name, metadata
from hybridfleet.spec.models import JobSpec

TOKEN_PREFIX = "worker-token-"  # worker-token-<worker id>: one worker's bearer token, read from HFLEET_TOKEN_FILE
SHARD_ROLE = "ps"


@dataclass(frozen=True)
class CredentialSource:
    """Where Secret values come from: a `hfleet certs init` directory, or placeholders (explicit)."""

    certs_dir: Path | None = None
    placeholders: bool = False


def tls_on(spec: JobSpec) -> bool:
    return spec.security.tls != "off"


def tokens_on(spec: JobSpec) -> bool:
    return spec.security.tokens != "off"


def secret_name(spec: JobSpec, owner: str, site_rank: int | None = None) -> str:
    """``<job>-creds-ps`` for the shards, ``<job>-creds-<site>-<rank>`` for one worker of a site."""
    return dns_name(spec.name, "creds", owner, *(() if site_rank is None else (str(site_rank),)))


def client_cert_name(site: str) -> str:
    """The client certificate a site shows under mutual TLS (`hfleet certs init --client SITE`)."""
    return site


def token_file(worker: str) -> str:
    """The Secret key (and file name) of worker ``worker``'s token."""
    return f"{TOKEN_PREFIX}{worker}"


def secret_files(spec: JobSpec, owner: str, site_rank: int | None = None) -> list[str]:
    """The files of ``owner``'s Secret: ``ps`` for the shards, else a site name with the ``site_rank`` of
    one worker (only its own token), or None for every worker of the site (the plain-host bundle)."""
    from hybridfleet.security.certs import CA_CERT, CLIENT_PREFIX, SERVER_CERT, SERVER_KEY
    from hybridfleet.security.tokens import VERIFY_KEY

    files: list[str] = []
    if owner == SHARD_ROLE:
        if tls_on(spec):
            files += [CA_CERT, SERVER_CERT, SERVER_KEY]
        if tokens_on(spec):
            files.append(VERIFY_KEY)
        return files
    if tls_on(spec):
        files.append(CA_CERT)
        if spec.security.mutual_tls:
            name = client_cert_name(owner)
            files += [f"{CLIENT_PREFIX}{name}.pem", f"{CLIENT_PREFIX}{name}.key"]
    if tokens_on(spec):
        from hybridfleet.security.credentials import site_worker_ids, worker_id

        workers = site_worker_ids(spec, owner) if site_rank is None else [worker_id(owner, site_rank)]
        files += [token_file(w) for w in workers]
    if site_rank in (None, 0) and spec.sites[owner].aggregate and spec.sites[owner].workers > 1:
        files += hub_files(spec, owner)  # the leader runs the site hub
    return files


def hub_files(spec: JobSpec, site: str) -> list[str]:
    """The files the leader of aggregating ``site`` needs for its site hub: the hub certificate (TLS
    on) and the job's token-verifying public key (tokens on); never the shards' key."""
    from hybridfleet.security.certs import hub_certificate_paths
    from hybridfleet.security.tokens import VERIFY_KEY

    files = []
    if tls_on(spec):
        pair = hub_certificate_paths(".", site)
        files += [pair.cert.name, pair.key.name]
    if tokens_on(spec):
        files.append(VERIFY_KEY)
    return files


def certs_init_command(spec: JobSpec, hosts: list[str]) -> str:
    """The `hfleet certs init` command that makes a directory every rendered Secret can be filled from."""
    args = [f"--host {h}" for h in hosts]
    if spec.security.mutual_tls:
        args += [f"--client {client_cert_name(site)}" for site in spec.sites]
    return " ".join(["hfleet certs init certs/", *args])


def check_server_names(certs_dir: Path, hosts: list[str]) -> None:
    """Refuse a server certificate that lacks a name the workers dial (they would fail TLS hostname checks)."""
    from hybridfleet.security.certs import SERVER_CERT, describe_certificate

    sans = set(describe_certificate("server", certs_dir / SERVER_CERT).sans)
    missing = [h for h in hosts if h not in sans]
    if missing:
        raise AuthError(f"{certs_dir / SERVER_CERT} lacks the names workers dial: {', '.join(missing)} "
                        f"(it has {', '.join(sorted(sans)) or 'none'}); remake it with --host for each")


def credential_value(spec: JobSpec, owner: str, name: str, source: CredentialSource) -> str:
    """The content of file ``name`` for ``owner``: read from the certs directory, a token issued from
    its signing key, or a placeholder when there is no directory."""
    if source.certs_dir is None:
        return f"REPLACE-with-{name}-from-hfleet-certs"
    if name.startswith(TOKEN_PREFIX):
        from hybridfleet.security.credentials import issue_site_credentials
        from hybridfleet.security.tokens import TokenIssuer

        # tokens live security.token_ttl_s; a re-rendered Secret, once applied, renews them in every
        # pod's mounted files, which workers re-read when they change
        issued = issue_site_credentials(spec, owner, TokenIssuer.from_dir(source.certs_dir))
        return issued.workers[name[len(TOKEN_PREFIX):]].token
    path = source.certs_dir / name
    hub_site = _hub_site(name)
    if hub_site is not None and not path.is_file():
        from hybridfleet.security import load_pki
        from hybridfleet.security.certs import issue_hub_certificate

        issue_hub_certificate(load_pki(source.certs_dir), hub_site)  # like a token, issued from the CA
    if not path.is_file():
        hint = (f"make it with `hfleet certs init {source.certs_dir} --client {client_cert_name(owner)} ...`"
                if name.startswith("client-") else f"make the directory with `hfleet certs init {source.certs_dir}`")
        raise AuthError(f"--certs {source.certs_dir}: missing {name}, needed by the {owner} Secret; {hint}")
    return path.read_text()


def _hub_site(name: str) -> str | None:
    """The site of a site hub certificate or key file name, else None."""
    from hybridfleet.security.certs import HUB_PREFIX

    if name.startswith(HUB_PREFIX) and name.endswith((".pem", ".key")):
        return name[len(HUB_PREFIX):].rsplit(".", 1)[0]
    return None


def credential_secret(spec: JobSpec, owner: str, source: CredentialSource,
                      site_rank: int | None = None) -> Manifest | None:
    """``owner``'s Secret (for a site: worker ``site_rank``'s), None when the job needs no credentials;
    values from ``source``.

    Raises UsageError when neither a certs directory nor explicit placeholders were given, and
    AuthError when the certs directory lacks a file.
    """
    files = secret_files(spec, owner, site_rank)
    if not files:
        return None
    if source.certs_dir is None and not source.placeholders:
        raise UsageError("k8s render: the job needs credentials and neither --certs nor --placeholders was given",
                         hint="pass --certs DIR (from `hfleet certs init`) for real Secrets, or --placeholders to "
                              "write REPLACE-with-... values to fill in later")
    data = {name: credential_value(spec, owner, name, source) for name in files}
    body = metadata(spec, secret_name(spec, owner, site_rank), "credentials")
    body["labels"]["hybridfleet/credentials-for"] = dns_name(owner, *(() if site_rank is None else (str(site_rank),)))
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": body, "stringData": data}
