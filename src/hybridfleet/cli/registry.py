"""`hfleet registry`: model versions, aliases, gates, gray release, permissions; local DB or server."""

from __future__ import annotations

import json
from typing import Any

import typer

from hybridfleet.errors import GateFailedError, RegistryError

group = typer.Typer(help="Model registry: publish, promote, rollout, resolve, pull, history, serve.", no_args_is_help=True)

REGISTRY_HELP = "registry: http(s)://server, sqlite:///PATH, postgresql://... (default: $HFLEET_REGISTRY or the project's .hfleet/registry)"
TOKEN_HELP = "token of a user or service account (default: $HFLEET_REGISTRY_TOKEN; none: local database owner)"
Url = typer.Option(None, "--registry", "-r", help=REGISTRY_HELP)
Token = typer.Option(None, "--token", help=TOKEN_HELP)
Ca = typer.Option(None, "--ca", help="CA certificate (PEM) of an https:// server, e.g. certs/ca.pem (default: $HFLEET_REGISTRY_CA)")


def _open(registry: str | None, token: str | None, store: str | None = None, ca: str | None = None):
    from hybridfleet.registry.client import open_registry

    return open_registry(registry, token, store, ca)


def _echo(data: Any) -> None:
    if hasattr(data, "to_dict"):
        data = data.to_dict()
    elif isinstance(data, list):
        data = [d.to_dict() if hasattr(d, "to_dict") else d for d in data]
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def _one_line(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): a stored value never prints as its own line."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text))


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RegistryError(f"{what} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _numbers(pairs: dict[str, str]) -> dict[str, float]:
    out = {}
    for key, text in pairs.items():
        try:
            out[key] = float(text)
        except ValueError:
            raise RegistryError(f"--metric {key}={text!r}: expected NAME=NUMBER") from None
    return out


@group.command("init")
def init(registry: str | None = Url, store: str | None = typer.Option(None, help="artifact store: file:///DIR or s3://BUCKET/PREFIX")) -> None:
    """Create a registry database (newest schema) and fix its artifact store."""
    from hybridfleet.registry import Registry

    reg = Registry(registry, store=store)
    typer.echo(f"registry {reg.db_url} ready; artifacts in {reg.store_url}")


@group.command("migrate")
def migrate(db: str | None = typer.Option(None, "--db", help="database URL or SQLite path")) -> None:
    """Migrate a registry database to this hfleet's schema (back it up first)."""
    from hybridfleet.registry import db as registry_db

    url = db or registry_db.default_db_url()
    engine = registry_db.make_engine(url)
    before = registry_db.current_revision(engine)
    registry_db.upgrade(engine)
    typer.echo(f"{url}: schema {before or 'empty'} -> {registry_db.current_revision(engine)}")


@group.command("publish")
def publish(name: str = typer.Argument(..., help="[NAMESPACE/]NAME"),
            checkpoint: str = typer.Argument(..., help="a run's model dir (with MODEL.json) or any checkpoint root URL"),
            step: int | None = typer.Option(None, help="checkpoint step (default: newest; or the run's final/best)"),
            which: str = typer.Option("final", help="for a run's model dir: final or best"),
            tag: list[str] = typer.Option([], "--tag", help="KEY=VALUE, repeatable"),
            metric: list[str] = typer.Option([], "--metric", help="NAME=NUMBER, repeatable; stored as claimed (a gate "
                                             "refuses claims unless --trust-claimed)"),
            description: str = typer.Option("", help="free text"),
            registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Register a checkpoint as NAME's next immutable version (blobs already in the store are not copied)."""
    from hybridfleet.store import open_store

    tags = _pairs(tag, "--tag")
    claims = _numbers(_pairs(metric, "--metric"))
    reg = _open(registry, token, ca=ca)
    if step is None and open_store(checkpoint).exists("MODEL.json"):
        info = reg.register_run(name, checkpoint, which, description, tags, claims)
    else:
        info = reg.register(name, checkpoint, step, description, tags, claims)
    typer.echo(f"registered {info.name} v{info.version} (manifest sha256 {info.manifest_sha256[:12]}..., "
               f"{info.copied_bytes if info.copied_bytes is not None else '?'} bytes copied)")
    if info.duplicate_of is not None:
        typer.echo(f"note: v{info.version} has exactly the tensors of v{info.duplicate_of} (same checkpoint published "
                   f"again?); `hfleet registry alias` points an alias at an existing version without a new one", err=True)


@group.command("ls")
def ls(namespace: str | None = typer.Argument(None), registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:
    """Models (in NAMESPACE) with their newest version."""
    for m in _open(registry, token, ca=ca).list_models(namespace):
        typer.echo(f"{m['name']:<40} v{m['latest'] if m['latest'] is not None else '-':<6} {m['description']}")


@group.command("show")
def show(ref: str = typer.Argument(..., help="NAME, NAME@ALIAS or NAME@VERSION"), registry: str | None = Url,
         token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """One version as JSON: manifest sha256, metrics, lineage, tags."""
    _echo(_open(registry, token, ca=ca).get_version(ref))


@group.command("versions")
def versions(name: str, registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:
    """Every version of NAME as JSON, oldest first."""
    _echo(_open(registry, token, ca=ca).list_versions(name))


@group.command("search")
def search(tag: list[str] = typer.Option(..., "--tag", help="KEY=VALUE, repeatable; all must match"),
           namespace: str | None = typer.Option(None), registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Versions carrying every given tag, newest first."""
    _echo(_open(registry, token, ca=ca).search(_pairs(tag, "--tag"), namespace))


@group.command("tag")
def tag_version(ref: str, tags: list[str] = typer.Argument(..., help="KEY=VALUE ..."), registry: str | None = Url,
                token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Add or replace tags on a version."""
    _echo(_open(registry, token, ca=ca).set_tags(ref, _pairs(tags, "tag")))


@group.command("alias")
def alias(name: str, alias_name: str = typer.Argument(..., metavar="ALIAS"), version: int = typer.Argument(...),
          reason: str = typer.Option("", help="recorded in the history"),
          expect_revision: int | None = typer.Option(None, help="refuse (conflict) unless the alias is at this revision"),
          registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Point ALIAS of NAME at VERSION (no gate; `promote` gates)."""
    _echo(_open(registry, token, ca=ca).move_alias(name, alias_name, version, reason, expect_revision))


@group.command("protect")
def protect(name: str, alias_name: str = typer.Argument(..., metavar="ALIAS"),
            off: bool = typer.Option(False, "--off", help="remove the protection"),
            registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Protect an alias: only releasers may move it (`prod` is protected from its creation)."""
    _echo(_open(registry, token, ca=ca).protect_alias(name, alias_name, not off))


@group.command("history")
def history(name: str, alias_name: str | None = typer.Option(None, "--alias"), registry: str | None = Url,
            token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Who moved which alias from which version to which, when and why (append-only)."""
    import time

    for e in _open(registry, token, ca=ca).history(name, alias_name):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at_s"]))
        canary = f" canary v{e['canary_version']} at {e['canary_weight']:g}%" if e["canary_version"] is not None else ""
        typer.echo(f"{when}Z  {e['alias']:<10} {e['action']:<9} v{e['from_version'] or '-'} -> v{e['to_version']}"
                   f"{canary}  by {e['actor']}  {_one_line(e['reason'])}".rstrip())


@group.command("promote")
def promote(name: str, version: str = typer.Argument(..., help="candidate: a version number or an alias naming it"),
            alias_name: str = typer.Option(..., "--alias"),
            require: list[str] = typer.Option([], "--require", help="METRIC OP NUMBER, e.g. 'test_accuracy>=0.95'; repeatable"),
            no_regression_vs: str | None = typer.Option(None, "--no-regression-vs", help="alias or version to compare with"),
            tolerance: float = typer.Option(0.0, help="allowed regression vs --no-regression-vs"),
            reason: str = typer.Option("", help="recorded in the history"),
            trust_claimed: bool = typer.Option(False, "--trust-claimed", help="accept metrics the writer only claimed"),
            evaluate: str | None = typer.Option(None, "--evaluate", metavar="SCRIPT",
                                                help="measure the version first: `python SCRIPT WEIGHTS` prints one JSON "
                                                     "object of metrics; recorded as measured, with the script's sha256"),
            evaluate_timeout: float = typer.Option(600.0, "--evaluate-timeout", help="seconds the script may take"),
            as_json: bool = typer.Option(False, "--json", help="print the machine-readable result"),
            registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Move ALIAS to VERSION only if the gate passes; exit 25 with the reasons otherwise.

    The gate reads the checkpoint's own metrics and what --evaluate measures; claimed ones only with --trust-claimed.
    """
    candidate: int | str = int(version.lstrip("v")) if version.lstrip("v").isdigit() else version
    reg = _open(registry, token, ca=ca)
    measurement = None
    if evaluate:
        from hybridfleet.registry.evaluate import measure
        from hybridfleet.registry.gate import parse_requirement

        for text in require:  # a typo is refused before the evaluation runs
            parse_requirement(text)

        measurement = measure(reg, f"{name}@{candidate}", evaluate, evaluate_timeout)
    try:
        result = reg.promote(name, candidate, alias_name, require, no_regression_vs, tolerance, reason, trust_claimed,
                             measurement)  # fmt: skip
    except GateFailedError as err:
        if as_json:
            typer.echo(json.dumps({"name": name, "version": version, "alias": alias_name, "passed": False,
                                   "checks": err.reasons, "error": str(err)}, indent=2))  # fmt: skip
        raise
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        if result.get("measured"):
            shown = " ".join(f"{k}={v:g}" for k, v in sorted(result["measured"]["metrics"].items()))
            typer.echo(f"measured {result['name']} v{result['version']} with {evaluate}: {shown}")
        verdict = "gate passed" if result.get("checked") else "no requirement given: nothing was checked"
        typer.echo(f"{result['name']}@{alias_name} -> v{result['version']} ({verdict})")


@group.command("rollout")
def rollout(name: str, alias_name: str = typer.Option(..., "--alias"),
            canary: str | None = typer.Option(None, help="canary version, or an alias naming it (e.g. the gated candidate)"),
            weight: float | None = typer.Option(None, help="percent of keys on the canary"),
            promote_: bool = typer.Option(False, "--promote", help="the canary becomes the stable version"),
            rollback: bool = typer.Option(False, "--rollback", help="drop the canary"),
            reason: str = typer.Option(""), registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Gray release on an alias: --canary V --weight W, --weight W, --promote or --rollback.

    --canary takes a version number or an alias; an alias is read once, here, and the
    rollout records the version it named.
    """
    reg = _open(registry, token, ca=ca)
    version: int | None = None
    if canary is not None:
        text = canary.lstrip("v")
        version = int(text) if text.isdigit() else reg.get_version(f"{name}@{canary}").version
    _echo(reg.rollout(name, alias_name, version, weight, promote_, rollback, reason))


@group.command("resolve")
def resolve(ref: str = typer.Argument(..., help="NAME@ALIAS (or @VERSION)"),
            key: str | None = typer.Option(None, help="request key (user id ...): sticky under gray release"),
            registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Print the version a reference resolves to (for KEY, under gray release) as JSON."""
    _echo(_open(registry, token, ca=ca).resolve(ref, key))


@group.command("pull")
def pull(ref: str, framework: str | None = typer.Option(None, help="torch or paddle (default: the version's own)"),
         fmt: str = typer.Option("safetensors", "--format", help="safetensors, pt (torch) or pdparams (paddle)"),
         out: str | None = typer.Option(None, "-o", "--out", help="output directory (default: ./NAME-vN)"),
         key: str | None = typer.Option(None, help="resolve a gray-release alias for this key"),
         registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Verify every byte of a version, then write its weights for FRAMEWORK (converted if needed)."""
    result = _open(registry, token, ca=ca).pull(ref, framework, fmt, out, key)
    typer.echo(f"{result['name']} v{result['version']} -> {result['path']}")


@group.command("export")
def export(source: str = typer.Argument(..., help="NAME@ALIAS / NAME@VERSION, or a run's model dir / checkpoint root"),
           fmt: str = typer.Option(..., "--format", help="onnx, torch-export or paddle-inference"),
           out: str = typer.Option(..., "-o", "--out", help="new (or empty) output folder"),
           model: str = typer.Option(..., "--model", help="the job's model factory: FILE.py:FUNC or package.module:FUNC"),
           model_arg: list[str] = typer.Option([], "--model-arg", help="KEY=VALUE passed to the factory; repeatable"),
           sample: str | None = typer.Option(None, help=".npy of real inputs (default: the factory module's sample_inputs())"),
           tolerance: float = typer.Option(1e-5, help="largest absolute output difference accepted"),
           upload: bool = typer.Option(True, help="copy the artefact into the registry store and tag the version"),
           registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Export a version with the framework's exporter; kept only if its runtime reproduces the model's outputs."""
    from pathlib import Path

    from hybridfleet.serve.export import export_checkpoint, export_version

    args = _pairs(model_arg, "--model-arg")
    if "://" in source or Path(source).expanduser().exists():
        result = export_checkpoint(source, fmt, out, model, args, sample, tolerance)
    else:
        result = export_version(_open(registry, token), source, fmt, out, model, args, sample, tolerance, upload)
    v = result["verification"]
    typer.echo(f"{fmt} artefact verified on {v['samples']} inputs (max |diff| {v['max_abs_diff']:.3g} <= {v['tolerance']:g}) "
               f"-> {result['path']}" + (f"; stored at {result['uri']}" if result.get("uri") else ""))


@group.command("import")
def import_(source: str = typer.Argument(..., help="hf:ORG/NAME@REV or modelscope:ORG/NAME@REV"),
            name: str | None = typer.Option(None, "--as", help="[NAMESPACE/]NAME (default: hub/<name>)"),
            cache_dir: str | None = typer.Option(None, help="the hub library's cache (default: its own)"),
            offline: bool = typer.Option(False, help="use only the local hub cache; never touch the network"),
            registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Import a hub model pinned to the resolved revision, verified complete, as a new version."""
    from hybridfleet.registry.hub import import_model

    info = import_model(_open(registry, token, ca=ca), source, name, cache_dir, offline)
    typer.echo(f"imported {source} (revision {info.lineage['hub']['resolved_revision']}) as {info.name} v{info.version}")


principal = typer.Typer(help="Users and service accounts.", no_args_is_help=True)


TTL_HELP = "token lifetime: 30d, 12h, 45m, 600s or never (default: never)"


@principal.command("add")
def principal_add(name: str, kind: str = typer.Option("user", help="user or service"),
                  ttl: str | None = typer.Option(None, "--ttl", help=TTL_HELP),
                  registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Create a principal and print its token (shown once)."""
    typer.echo(_open(registry, token, ca=ca).add_principal(name, kind, ttl=ttl))


@principal.command("token")
def principal_token(name: str, ttl: str | None = typer.Option(None, "--ttl", help=TTL_HELP),
                    keep_old: bool = typer.Option(False, "--keep-old", help="the current token stays valid until its own expiry"),
                    registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Issue a new token for NAME and print it (shown once); the old one stops working unless --keep-old."""
    typer.echo(_open(registry, token, ca=ca).rotate_token(name, ttl, keep_old))


@principal.command("remove")
def principal_remove(name: str, registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:
    """Delete a principal and its grants (its token stops working)."""
    _open(registry, token, ca=ca).remove_principal(name)
    typer.echo(f"removed {name}")


group.add_typer(principal, name="principal")


@group.command("grant")
def grant(principal_name: str = typer.Argument(..., metavar="PRINCIPAL"),
          role: str = typer.Argument(..., help="reader, writer, releaser or admin"),
          scope: str = typer.Argument(..., help="*, NAMESPACE or NAMESPACE/NAME"),
          registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:  # fmt: skip
    """Give PRINCIPAL ROLE on SCOPE."""
    _echo(_open(registry, token, ca=ca).grant(principal_name, role, scope))


@group.command("whoami")
def whoami(registry: str | None = Url, token: str | None = Token, ca: str | None = Ca) -> None:
    """The principal the token belongs to, and its grants."""
    _echo(_open(registry, token, ca=ca).whoami())


@group.command("serve")
def serve(db: str | None = typer.Option(None, "--db", help="database URL or SQLite path"),
          host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8080),
          store: str | None = typer.Option(None, help="artifact store (fixed when the registry is created)"),
          allow_path: list[str] = typer.Option([], "--allow-path", help="a local folder clients may register checkpoints from; repeatable"),
          certs: str | None = typer.Option(None, "--certs", help="serve TLS with DIR/server.pem + server.key (`hfleet certs init DIR`); needed off loopback"),
          client_ca: str | None = typer.Option(None, "--client-ca", help="mutual TLS: clients must show a certificate signed by this CA (PEM)"),
          ) -> None:  # fmt: skip
    """Serve the registry over REST with token auth (TLS with --certs); OpenAPI at /openapi.json."""
    from hybridfleet.registry.server import serve as run_server

    run_server(db, host, port, store, allow_path, certs, client_ca,
               announce=lambda url: typer.echo(f"hfleet registry serve: {url}/api/v1 (OpenAPI at {url}/docs)", err=True))


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="registry")
