"""`hfleet certs`: TLS certificates and signed tokens for real deployments."""

from __future__ import annotations

from pathlib import Path

import typer

from hybridfleet.errors import AuthError
from hybridfleet.ps.wire.protocol import METHOD_ROLES
from hybridfleet.security import certs, tokens

# the roles a shard accepts for some call (see hybridfleet.ps.wire.protocol.METHOD_ROLES)
TOKEN_ROLES = tuple(sorted(set().union(*METHOD_ROLES.values())))

group = typer.Typer(help="TLS certificates and signed tokens for real deployments.", no_args_is_help=True)


@group.command("init")
def init(
    directory: Path = typer.Argument(..., help="directory to create the PKI in"),
    host: list[str] = typer.Option(
        list(certs.DEFAULT_HOSTS), "--host", "--san",
        help="IP or DNS name the server is dialled at, a SubjectAltName (repeat for each; a placeholder Secret of "
             "`hfleet k8s render` gives the command with the names its manifests dial)"
    ),
    client: list[str] = typer.Option(
        list(certs.DEFAULT_CLIENTS), "--client", help="client certificate name for mutual TLS (repeat for each)"
    ),
    valid_days: float = typer.Option(certs.DEFAULT_VALID_DAYS, "--valid-days", help="certificate lifetime in days"),
    force: bool = typer.Option(False, "--force", help="replace an existing PKI in DIRECTORY"),
) -> None:
    """Create a CA, a server certificate (one SAN per --host), client certificates and the token signing key."""
    key_files = [directory / tokens.SIGNING_KEY, directory / tokens.VERIFY_KEY]
    existing = [str(path) for path in key_files if path.exists()]
    if existing and not force:  # checked first so a refusal leaves DIRECTORY untouched
        raise AuthError(f"refusing to overwrite {', '.join(existing)}; pass --force to replace the PKI",
                        hint=f"choose a new directory, or pass --force to replace the PKI in {directory} "
                             "(tokens and certificates made from it stop working)")
    try:
        pki = certs.make_dev_pki(directory, hosts=host, clients=client, valid_days=valid_days, overwrite=force)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    signing_key, verify_key = tokens.generate_signing_key(directory, overwrite=force)
    for path in [pki.ca_cert, pki.server_cert, pki.server_key, signing_key, verify_key]:
        typer.echo(str(path))
    for pair in pki.clients.values():
        typer.echo(str(pair.cert))
        typer.echo(str(pair.key))


@group.command("token")
def token(
    directory: Path = typer.Argument(..., help="PKI directory holding token-signing.key"),
    job: str = typer.Option(..., "--job", help="job the token is valid for"),
    site: str = typer.Option(..., "--site", help="site of the caller"),
    role: str = typer.Option(..., "--role", help=f"role of the caller: {', '.join(TOKEN_ROLES)}"),
    ttl_s: float = typer.Option(24 * 3600, "--ttl-s", help="seconds until the token expires"),
    subject: str | None = typer.Option(None, "--subject", help="optional subject, e.g. hospital/worker-0"),
    worker: str | None = typer.Option(None, "--worker", help="the worker id the token is bound to, SITE-RANK "
                                                            "(shards refuse worker tokens without one)"),
) -> None:
    """Print a signed token for JOB/SITE/ROLE on stdout."""
    if role not in TOKEN_ROLES:
        raise typer.BadParameter(f"must be one of {', '.join(TOKEN_ROLES)} (got {role!r}); shards accept no other role",
                                 param_hint="--role")
    issuer = tokens.TokenIssuer.from_dir(directory)
    try:
        signed = issuer.issue(job=job, site=site, role=role, ttl_s=ttl_s, subject=subject, worker=worker)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(signed)


@group.command("hub")
def hub(
    directory: Path = typer.Argument(..., help="PKI directory holding the CA key"),
    site: str = typer.Argument(..., help="the aggregating site whose leader serves its followers"),
    valid_days: float = typer.Option(certs.DEFAULT_VALID_DAYS, "--valid-days", help="certificate lifetime in days"),
) -> None:
    """Issue the site hub certificate of SITE (kept if it exists) and print its paths; give them to the
    site leader as HFLEET_SITE_HUB_CERT / HFLEET_SITE_HUB_KEY, with HFLEET_TOKEN_VERIFY_KEY=DIR/token-signing.pub."""
    try:
        pair = certs.issue_hub_certificate(certs.load_pki(directory), site, valid_days=valid_days)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="SITE") from None
    typer.echo(str(pair.cert))
    typer.echo(str(pair.key))


@group.command("revoke")
def revoke(
    directory: Path = typer.Argument(..., help="PKI directory the shards verify tokens from"),
    token_id: list[str] = typer.Argument(..., help="the jti of each token to revoke, or the token itself"),
) -> None:
    """Add token ids to DIRECTORY's revocation list; shards refuse them within a second."""
    ids = []
    for item in token_id:
        jti = tokens.unverified_claims(item).get("jti") if item.count(".") == 2 else item
        if not isinstance(jti, str) or not jti:
            raise AuthError("that token carries no 'jti' claim; it cannot be revoked (issue a new one)")
        ids.append(jti)
    typer.echo(str(tokens.revoke(directory, ids)))


@group.command("show")
def show(directory: Path = typer.Argument(..., help="PKI directory")) -> None:
    """Show each certificate's subject, SANs and expiry, and whether the token keys are present."""
    pki = certs.load_pki(directory)
    for info in certs.describe_pki(pki):
        typer.echo(f"{info.name}: {info.path}")
        typer.echo(f"  subject:   {info.subject}")
        typer.echo(f"  issuer:    {info.issuer}")
        if info.sans:
            typer.echo(f"  sans:      {', '.join(info.sans)}")
        typer.echo(f"  expires:   {info.not_after.isoformat()}")
        typer.echo(f"  sha256:    {info.sha256_fingerprint}")
    for name in (tokens.SIGNING_KEY, tokens.VERIFY_KEY):
        state = "present" if (pki.directory / name).is_file() else "missing"
        typer.echo(f"token key {name}: {state}")


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="certs")
