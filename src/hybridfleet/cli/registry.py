"""`hfleet registry`: model versions, aliases, gates, gray release, permissions; local DB or server."""

from __future__ import annotations

import json
from typing import Any

import typer

from hybridfleet.errors import GateFailedError, RegistryError

group = typer.Typer(help="Model registry: publish, promote, rollout, resolve, pull, history, serve.", no_args_is_help=True)

REGISTRY_HELP = "registry: http(s)://server, sqlite:///PATH, postgresql://... (default: $HFLEET_REGISTRY or ~/.hfleet/registry)"
TOKEN_HELP = "token of a user or service account (default: $HFLEET_REGISTRY_TOKEN; none: local database owner)"
Url = typer.Option(None, "--registry", "-r", help=REGISTRY_HELP)
Token = typer.Option(None, "--token", help=TOKEN_HELP)


def _open(registry: str | None, token: str | None, store: str | None = None):
    from hybridfleet.registry.client import open_registry

    return open_registry(registry, token, store)


def _echo(data: Any) -> None:
    if hasattr(data, "to_dict"):
        data = data.to_dict()
    elif isinstance(data, list):
        data = [d.to_dict() if hasattr(d, "to_dict") else d for d in data]
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RegistryError(f"{what} {item!r}: expected KEY=VALUE")
        out[key] = value
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
            description: str = typer.Option("", help="free text"),
            registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Register a checkpoint as NAME's next immutable version (blobs already in the store are not copied)."""
    from hybridfleet.store import open_store

    reg = _open(registry, token)
    tags = _pairs(tag, "--tag")
    if step is None and open_store(checkpoint).exists("MODEL.json"):
        info = reg.register_run(name, checkpoint, which, description, tags)
    else:
        info = reg.register(name, checkpoint, step, description, tags)
    typer.echo(f"registered {info.name} v{info.version} (manifest sha256 {info.manifest_sha256[:12]}..., "
               f"{info.copied_bytes if info.copied_bytes is not None else '?'} bytes copied)")


@group.command("ls")
def ls(namespace: str | None = typer.Argument(None), registry: str | None = Url, token: str | None = Token) -> None:
    """Models (in NAMESPACE) with their newest version."""
    for m in _open(registry, token).list_models(namespace):
        typer.echo(f"{m['name']:<40} v{m['latest'] if m['latest'] is not None else '-':<6} {m['description']}")


@group.command("show")
def show(ref: str = typer.Argument(..., help="NAME, NAME@ALIAS or NAME@VERSION"), registry: str | None = Url,
         token: str | None = Token) -> None:  # fmt: skip
    """One version as JSON: manifest sha256, metrics, lineage, tags."""
    _echo(_open(registry, token).get_version(ref))


@group.command("versions")
def versions(name: str, registry: str | None = Url, token: str | None = Token) -> None:
    """Every version of NAME as JSON, oldest first."""
    _echo(_open(registry, token).list_versions(name))


@group.command("search")
def search(tag: list[str] = typer.Option(..., "--tag", help="KEY=VALUE, repeatable; all must match"),
           namespace: str | None = typer.Option(None), registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Versions carrying every given tag, newest first."""
    _echo(_open(registry, token).search(_pairs(tag, "--tag"), namespace))


@group.command("tag")
def tag_version(ref: str, tags: list[str] = typer.Argument(..., help="KEY=VALUE ..."), registry: str | None = Url,
                token: str | None = Token) -> None:  # fmt: skip
    """Add or replace tags on a version."""
    _echo(_open(registry, token).set_tags(ref, _pairs(tags, "tag")))


@group.command("alias")
def alias(name: str, alias_name: str = typer.Argument(..., metavar="ALIAS"), version: int = typer.Argument(...),
          reason: str = typer.Option("", help="recorded in the history"),
          expect_revision: int | None = typer.Option(None, help="refuse (conflict) unless the alias is at this revision"),
          registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Point ALIAS of NAME at VERSION (no gate; `promote` gates)."""
    _echo(_open(registry, token).move_alias(name, alias_name, version, reason, expect_revision))


@group.command("protect")
def protect(name: str, alias_name: str = typer.Argument(..., metavar="ALIAS"),
            off: bool = typer.Option(False, "--off", help="remove the protection"),
            registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Protect an alias: only releasers may move it (`prod` is protected from its creation)."""
    _echo(_open(registry, token).protect_alias(name, alias_name, not off))


@group.command("history")
def history(name: str, alias_name: str | None = typer.Option(None, "--alias"), registry: str | None = Url,
            token: str | None = Token) -> None:  # fmt: skip
    """Who moved which alias from which version to which, when and why (append-only)."""
    import time

    for e in _open(registry, token).history(name, alias_name):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at_s"]))
        canary = f" canary v{e['canary_version']} at {e['canary_weight']:g}%" if e["canary_version"] is not None else ""
        typer.echo(f"{when}Z  {e['alias']:<10} {e['action']:<9} v{e['from_version'] or '-'} -> v{e['to_version']}"
                   f"{canary}  by {e['actor']}  {e['reason']}".rstrip())


@group.command("promote")
def promote(name: str, version: str = typer.Argument(..., help="candidate: a version number or an alias naming it"),
            alias_name: str = typer.Option(..., "--alias"),
            require: list[str] = typer.Option([], "--require", help="METRIC OP NUMBER, e.g. 'test_accuracy>=0.95'; repeatable"),
            no_regression_vs: str | None = typer.Option(None, "--no-regression-vs", help="alias or version to compare with"),
            tolerance: float = typer.Option(0.0, help="allowed regression vs --no-regression-vs"),
            reason: str = typer.Option("", help="recorded in the history"),
            as_json: bool = typer.Option(False, "--json", help="print the machine-readable result"),
            registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Move ALIAS to VERSION only if the gate passes; exit 25 with the reasons otherwise."""
    candidate: int | str = int(version.lstrip("v")) if version.lstrip("v").isdigit() else version
    try:
        result = _open(registry, token).promote(name, candidate, alias_name, require, no_regression_vs, tolerance, reason)
    except GateFailedError as err:
        if as_json:
            typer.echo(json.dumps({"name": name, "version": version, "alias": alias_name, "passed": False,
                                   "checks": err.reasons, "error": str(err)}, indent=2))  # fmt: skip
        raise
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(f"{result['name']}@{alias_name} -> v{result['version']} (gate passed)")


@group.command("rollout")
def rollout(name: str, alias_name: str = typer.Option(..., "--alias"),
            canary: int | None = typer.Option(None, help="canary version"),
            weight: float | None = typer.Option(None, help="percent of keys on the canary"),
            promote_: bool = typer.Option(False, "--promote", help="the canary becomes the stable version"),
            rollback: bool = typer.Option(False, "--rollback", help="drop the canary"),
            reason: str = typer.Option(""), registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Gray release on an alias: --canary V --weight W, --weight W, --promote or --rollback."""
    _echo(_open(registry, token).rollout(name, alias_name, canary, weight, promote_, rollback, reason))


@group.command("resolve")
def resolve(ref: str = typer.Argument(..., help="NAME@ALIAS (or @VERSION)"),
            key: str | None = typer.Option(None, help="request key (user id ...): sticky under gray release"),
            registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Print the version a reference resolves to (for KEY, under gray release) as JSON."""
    _echo(_open(registry, token).resolve(ref, key))


@group.command("pull")
def pull(ref: str, framework: str = typer.Option(..., help="torch or paddle"),
         fmt: str = typer.Option("safetensors", "--format", help="safetensors, pt (torch) or pdparams (paddle)"),
         out: str | None = typer.Option(None, "-o", "--out", help="output directory (default: ./NAME-vN)"),
         key: str | None = typer.Option(None, help="resolve a gray-release alias for this key"),
         registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Verify every byte of a version, then write its weights for FRAMEWORK (converted if needed)."""
    result = _open(registry, token).pull(ref, framework, fmt, out, key)
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
            registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Import a hub model pinned to the resolved revision, verified complete, as a new version."""
    from hybridfleet.registry.hub import import_model

    info = import_model(_open(registry, token), source, name, cache_dir, offline)
    typer.echo(f"imported {source} (revision {info.lineage['hub']['resolved_revision']}) as {info.name} v{info.version}")


principal = typer.Typer(help="Users and service accounts.", no_args_is_help=True)


@principal.command("add")
def principal_add(name: str, kind: str = typer.Option("user", help="user or service"),
                  registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Create a principal and print its token (shown once)."""
    typer.echo(_open(registry, token).add_principal(name, kind))


@principal.command("remove")
def principal_remove(name: str, registry: str | None = Url, token: str | None = Token) -> None:
    """Delete a principal and its grants (its token stops working)."""
    _open(registry, token).remove_principal(name)
    typer.echo(f"removed {name}")


group.add_typer(principal, name="principal")


@group.command("grant")
def grant(principal_name: str = typer.Argument(..., metavar="PRINCIPAL"),
          role: str = typer.Argument(..., help="reader, writer, releaser or admin"),
          scope: str = typer.Argument(..., help="*, NAMESPACE or NAMESPACE/NAME"),
          registry: str | None = Url, token: str | None = Token) -> None:  # fmt: skip
    """Give PRINCIPAL ROLE on SCOPE."""
    _echo(_open(registry, token).grant(principal_name, role, scope))


@group.command("whoami")
def whoami(registry: str | None = Url, token: str | None = Token) -> None:
    """The principal the token belongs to, and its grants."""
    _echo(_open(registry, token).whoami())


@group.command("serve")
def serve(db: str | None = typer.Option(None, "--db", help="database URL or SQLite path"),
          host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8080),
          store: str | None = typer.Option(None, help="artifact store (fixed when the registry is created)"),
          allow_path: list[str] = typer.Option([], "--allow-path", help="a local folder clients may register checkpoints from; repeatable"),
          ) -> None:  # fmt: skip
    """Serve the registry over REST with token auth; OpenAPI at /openapi.json."""
    from hybridfleet.registry.server import serve as run_server

    run_server(db, host, port, store, allow_path)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="registry")
