"""The registry's operations on a database + artifact store, each checked against the caller's role.

`Registry` is what the CLI uses on a local database and what the REST server wraps;
`hybridfleet.registry.client.RemoteRegistry` offers the same methods over HTTP.
Aliases, gray release and the promotion gate live in `hybridfleet.registry.aliases`.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import Connection, and_, bindparam, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from hybridfleet.errors import AuthError, CheckpointError, RegistryError, RegistryNotFoundError
from hybridfleet.registry import artifacts, auth, db, evidence
from hybridfleet.registry.refs import MAX_VERSION, ModelRef, check_tags, check_text, parse_name, parse_ref
from hybridfleet.registry.schema import (
    aliases,
    grants,
    models,
    principals,
    settings,
    version_tags,
    versions,
)
from hybridfleet.store import Store, open_store

# The hot path's statements are built once: SQLAlchemy then reuses their compiled form, so a
# resolve costs the database round trips and little Python.
_VERSION_OF_MODEL = (select(versions).join(models, models.c.id == versions.c.model_id)
                     .where(and_(models.c.namespace == bindparam("namespace"), models.c.name == bindparam("name"))))  # fmt: skip
_BY_NUMBER = _VERSION_OF_MODEL.where(versions.c.version == bindparam("version"))
_BY_ALIAS = _VERSION_OF_MODEL.join(aliases, and_(aliases.c.model_id == models.c.id, aliases.c.alias == bindparam("alias"),
                                                 aliases.c.version == versions.c.version))  # fmt: skip
_NEWEST = _VERSION_OF_MODEL.order_by(versions.c.version.desc()).limit(1)
_TAGS_OF_VERSION = select(version_tags.c.key, version_tags.c.value).where(version_tags.c.version_id == bindparam("version_id"))

STORE_ENV = "HFLEET_REGISTRY_STORE"
REGISTER_RETRIES = 5
MAX_SEARCH_TAGS = 16  # each tag is one join; SQLite allows 64 tables in a join


@dataclass
class VersionInfo:
    """One immutable model version."""

    name: str  # NAMESPACE/NAME
    version: int
    manifest_path: str
    manifest_sha256: str
    framework: str | None
    step: int | None
    size_bytes: int
    metrics: dict[str, float]
    lineage: dict[str, Any]
    description: str
    created_by: str
    created_s: float
    tags: dict[str, str] = field(default_factory=dict)
    metric_sources: dict[str, dict[str, Any]] = field(default_factory=dict)  # see `hybridfleet.registry.evidence`
    copied_bytes: int | None = None  # set by `register`: payload bytes it copied into the store
    duplicate_of: int | None = None  # set by `register`: the previous version, when it has exactly these tensors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version_info(full_name: str, row: Any, tags: dict[str, str]) -> VersionInfo:
    return VersionInfo(name=full_name, version=row.version, manifest_path=row.manifest_path,
                       manifest_sha256=row.manifest_sha256, framework=row.framework, step=row.step,
                       size_bytes=row.size_bytes, metrics=dict(row.metrics), lineage=dict(row.lineage),
                       description=row.description, created_by=row.created_by, created_s=row.created_s, tags=tags,
                       metric_sources=dict(row.metric_sources or {}))  # fmt: skip


class Registry:
    """A registry on ``db_url`` (SQLite path/URL or PostgreSQL URL), acting for ``token``'s principal.

    Without a token the caller is the database's owner (whoever can open the database
    file or has its credentials controls it anyway); the REST server always passes one.
    ``store`` sets the artifact store when the registry is created (default for SQLite:
    ``artifacts/`` next to the database file; PostgreSQL needs one).
    """

    def __init__(self, db_url: str | None = None, token: str | None = None, store: str | None = None,
                 create: bool = True, engine: Any = None):  # fmt: skip
        self.db_url = db_url or db.default_db_url()
        self.engine = engine or db.make_engine(self.db_url)
        db.check_schema(self.engine, self.db_url, create=create)
        self.store_url = self._store_setting(store)
        self._store: Store | None = None
        self.actor = self.authenticate(token) if token else auth.Actor(auth.LOCAL_OWNER, {}, owner=True)
        # Called with every checkpoint URL a registration reads (the REST server's --allow-path check).
        self.source_check: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ plumbing
    def _store_setting(self, wanted: str | None) -> str:
        with self.engine.begin() as conn:
            current = conn.execute(select(settings.c.value).where(settings.c.key == "store")).scalar()
            if current is not None:
                if wanted and open_store(wanted).url != current:
                    raise RegistryError(f"this registry keeps artifacts in {current}; it cannot switch to {wanted}")
                return current
            wanted = wanted or os.environ.get(STORE_ENV)
            if not wanted:
                url = db.normalize_url(self.db_url)
                if not url.startswith("sqlite:///"):
                    raise RegistryError("a PostgreSQL registry needs an artifact store: pass --store URL (file:// or s3://)")
                wanted = str(Path(url[len("sqlite:///"):]).parent / "artifacts")
            resolved = open_store(wanted).url
            conn.execute(insert(settings).values(key="store", value=resolved))
            return resolved

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.store_url)
        return self._store

    def authenticate(self, token: str) -> auth.Actor:
        """The principal a token belongs to, with its grants; AuthError for an unknown or expired token.

        A principal has its current token and, after a rotation that kept it, the previous
        one; each is valid until its own expiry.
        """
        digest = auth.token_digest(token)
        with self.engine.connect() as conn:
            row = conn.execute(select(principals).where(or_(principals.c.token_sha256 == digest,
                                                            principals.c.previous_token_sha256 == digest))).first()  # fmt: skip
            if row is None:
                raise AuthError("registry token is not valid (unknown or revoked)")
            expires = row.expires_s if row.token_sha256 == digest else row.previous_expires_s
            if expires is not None and time.time() >= expires:
                when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(expires))
                raise AuthError(f"registry token of {row.name} expired at {when}; "
                                f"an admin issues a new one with `hfleet registry principal token {row.name} --ttl 30d`")
            rows = conn.execute(select(grants.c.scope, grants.c.role).where(grants.c.principal == row.name)).all()
        return auth.Actor(row.name, {r.scope: r.role for r in rows}, expires_s=expires)

    def _model_id(self, conn: Connection, namespace: str, name: str) -> int:
        model_id = conn.execute(select(models.c.id).where(and_(models.c.namespace == namespace, models.c.name == name))).scalar()
        if model_id is None:
            raise RegistryNotFoundError(auth.not_found_message(namespace, name))
        return model_id

    def _tags(self, conn: Connection, version_ids: list[int]) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {i: {} for i in version_ids}
        if version_ids:
            for row in conn.execute(select(version_tags).where(version_tags.c.version_id.in_(version_ids))):
                out[row.version_id][row.key] = row.value
        return out

    def _version_row(self, conn: Connection, model_id: int, ref: ModelRef, version: int) -> Any:
        if not 1 <= version <= MAX_VERSION:  # never sent to the database: a driver overflow is no answer
            raise RegistryNotFoundError(f"model {ref.full_name} has no version {version}")
        row = conn.execute(select(versions).where(and_(versions.c.model_id == model_id, versions.c.version == version))).first()
        if row is None:
            raise RegistryNotFoundError(f"model {ref.full_name} has no version {version}")
        return row

    # ------------------------------------------------------------------ models and versions
    def create_model(self, name: str, description: str = "") -> dict[str, Any]:
        """Create ``[NAMESPACE/]NAME`` (writer on the namespace); RegistryError when it exists."""
        namespace, short = parse_name(name)
        self.actor.require("writer", namespace, short, "create a model", conceal=False)
        check_text(description, "description")
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(models).values(namespace=namespace, name=short, description=description,
                                                   created_by=self.actor.name, created_s=time.time()))  # fmt: skip
        except IntegrityError as err:
            raise RegistryError(f"model {namespace}/{short} exists already") from err
        return {"name": f"{namespace}/{short}", "description": description}

    def register(self, name: str, checkpoint_url: str, step: int | None = None, description: str = "",
                 tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None,
                 lineage: dict[str, Any] | None = None, **store_options: Any) -> VersionInfo:  # fmt: skip
        """Register a checkpoint (newest step, or ``step``) as the next version of ``name``.

        Blobs the store lacks are copied (verified on the way); a checkpoint already in the
        store copies none. The version's metrics are the checkpoint's own (source
        ``checkpoint``) plus ``metrics``, stored as *claimed* by the caller; a claim may
        not contradict the checkpoint, and a non-finite metric is refused. Needs writer;
        the model is created when absent.
        """
        return self._register(name, checkpoint_url, step, description, tags, metrics, lineage, None, store_options)

    def _register(self, name: str, checkpoint_url: str, step: int | None, description: str,
                  tags: dict[str, str] | None, claimed: dict[str, float] | None, lineage: dict[str, Any] | None,
                  card_metrics: dict[str, float] | None, store_options: dict[str, Any]) -> VersionInfo:  # fmt: skip
        namespace, short = parse_name(name)
        self.actor.require("writer", namespace, short, "register a version")
        check_text(description, "description")
        check_text(checkpoint_url, "checkpoint URL")
        check_tags(tags or {})
        if step is not None and not 0 <= step <= MAX_VERSION:
            raise RegistryError(f"step {step}: steps are 0 to {MAX_VERSION}")
        if self.source_check is not None:
            self.source_check(checkpoint_url)
        claims = evidence.finite_metrics(claimed, "metrics")
        source = open_store(checkpoint_url, **store_options)
        manifest = artifacts.source_manifest(source, step)
        own = evidence.finite_metrics(manifest.metrics, f"{source.url} (its manifest)")
        own_sources = {k: {"source": evidence.CHECKPOINT, "origin": "manifest"} for k in own}
        if card_metrics:
            card = evidence.finite_metrics(card_metrics, "MODEL.json")
            own.update(card)
            own_sources.update({k: {"source": evidence.CHECKPOINT, "origin": "MODEL.json"} for k in card})
        merged, sources = evidence.combine(own, own_sources, claims, self.actor.name)
        for attempt in range(REGISTER_RETRIES):
            try:
                return self._insert_version(namespace, short, source, manifest, merged, sources, lineage or {},
                                            description, tags or {})  # fmt: skip
            except (IntegrityError, OperationalError) as err:  # another registration took the number: take the next
                if attempt == REGISTER_RETRIES - 1 or (isinstance(err, OperationalError) and "locked" not in str(err)):
                    raise
        raise AssertionError("unreachable")

    def _insert_version(self, namespace: str, short: str, source: Store, manifest: Any, metrics: dict[str, float],
                        sources: dict[str, dict], lineage: dict[str, Any], description: str,
                        tags: dict[str, str]) -> VersionInfo:  # fmt: skip
        with self.engine.begin() as conn:
            model_id = conn.execute(select(models.c.id).where(and_(models.c.namespace == namespace, models.c.name == short))).scalar()
            if model_id is None:  # created with its first version, in the same transaction
                model_id = conn.execute(insert(models).values(namespace=namespace, name=short, description="",
                                                              created_by=self.actor.name, created_s=time.time())
                                        ).inserted_primary_key[0]  # fmt: skip
            number = (conn.execute(select(func.max(versions.c.version)).where(versions.c.model_id == model_id)).scalar() or 0) + 1
            path = artifacts.version_path(namespace, short, number)
            done = artifacts.copy_into_store(source, manifest, self.store, path)
            try:
                version_id = conn.execute(insert(versions).values(
                    model_id=model_id, version=number, manifest_path=path, manifest_sha256=done.manifest_sha256,
                    framework=manifest.framework, step=manifest.step, size_bytes=manifest.size_bytes,
                    metrics=metrics, metric_sources=sources, lineage=lineage, description=description, created_by=self.actor.name,
                    created_s=time.time())).inserted_primary_key[0]  # fmt: skip
                for key, value in tags.items():
                    conn.execute(insert(version_tags).values(version_id=version_id, key=key, value=str(value)))
            except BaseException:
                self.store.rm(path)  # the row is rolled back: so is the manifest
                raise
            row = self._version_row(conn, model_id, ModelRef(namespace, short), number)
            previous = conn.execute(select(versions.c.manifest_path).where(
                and_(versions.c.model_id == model_id, versions.c.version == number - 1))).first()  # fmt: skip
        info = _version_info(f"{namespace}/{short}", row, {k: str(v) for k, v in tags.items()})
        info.copied_bytes = done.copied_bytes
        if previous is not None and artifacts.same_tensors(self.store, previous.manifest_path, done.manifest):
            info.duplicate_of = number - 1
        return info

    def register_run(self, name: str, model_root: str, which: str = "final", description: str = "",
                     tags: dict[str, str] | None = None, metrics: dict[str, float] | None = None) -> VersionInfo:  # fmt: skip
        """Register a run's final (or best) model from its MODEL.json, with the run's lineage.

        The card's metrics count as the checkpoint's own; ``metrics`` are claims (see `register`).
        """
        from hybridfleet.ckpt.run_model import read_model_card

        if which not in ("final", "best"):
            raise RegistryError(f"which must be final or best (got {which!r})")
        namespace, short = parse_name(name)
        self.actor.require("writer", namespace, short, "register a version")
        if self.source_check is not None:
            self.source_check(model_root)  # and `register` checks the card's url, wherever it points
        card = read_model_card(model_root)
        if not isinstance(card.get("url"), str) or not isinstance(card.get(which, {}) or {}, dict):
            raise CheckpointError(f"{model_root}/MODEL.json: no checkpoint url in the card")
        chosen = card[which] or card["final"]
        lineage = dict(card["lineage"])
        claimed = metrics
        metrics = {**lineage.get("metrics", {}), **chosen.get("metrics", {})} if chosen is card["final"] else {}
        lineage["model"] = {"url": card["url"], "which": which if card[which] else "final", "step": chosen["step"]}
        return self._register(name, card["url"], chosen["step"], description, tags, claimed, lineage, metrics, {})

    def get_version(self, ref_text: str) -> VersionInfo:
        """The version a reference names (``NAME`` alone: the newest); reader."""
        from hybridfleet.registry.aliases import resolve_number

        ref = parse_ref(ref_text)
        self.actor.require("reader", ref.namespace, ref.name, "read versions")
        params = {"namespace": ref.namespace, "name": ref.name}
        if ref.version is not None:
            query, params["version"] = _BY_NUMBER, ref.version
        elif ref.alias is not None:
            query, params["alias"] = _BY_ALIAS, ref.alias
        else:
            query = _NEWEST
        with self.engine.connect() as conn:
            row = conn.execute(query, params).first()  # one query on the hot path; the slow path names what is missing
            if row is None:
                model_id = self._model_id(conn, ref.namespace, ref.name)
                row = self._version_row(conn, model_id, ref, resolve_number(conn, model_id, ref, None))
            tags = {t.key: t.value for t in conn.execute(_TAGS_OF_VERSION, {"version_id": row.id})}
            return _version_info(ref.full_name, row, tags)

    def list_versions(self, name: str) -> list[VersionInfo]:
        """Every version of a model, oldest first; reader."""
        namespace, short = parse_name(name)
        self.actor.require("reader", namespace, short, "list versions")
        with self.engine.connect() as conn:
            model_id = self._model_id(conn, namespace, short)
            rows = conn.execute(select(versions).where(versions.c.model_id == model_id).order_by(versions.c.version)).all()
            tags = self._tags(conn, [r.id for r in rows])
        return [_version_info(f"{namespace}/{short}", r, tags[r.id]) for r in rows]

    def list_models(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Models (in ``namespace``) the caller may read, with their newest version number."""
        query = (select(models.c.namespace, models.c.name, models.c.description, func.max(versions.c.version).label("latest"))
                 .select_from(models.outerjoin(versions, versions.c.model_id == models.c.id))
                 .group_by(models.c.id, models.c.namespace, models.c.name, models.c.description)
                 .order_by(models.c.namespace, models.c.name))  # fmt: skip
        if namespace:
            parse_name(f"{namespace}/x")
            query = query.where(models.c.namespace == namespace)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [{"name": f"{r.namespace}/{r.name}", "description": r.description, "latest": r.latest}
                for r in rows if self.actor.role_on(r.namespace, r.name)]  # fmt: skip

    def search(self, tags: dict[str, str], namespace: str | None = None, limit: int = 100) -> list[VersionInfo]:
        """Versions carrying every ``key=value`` in ``tags`` (newest first), among models the caller may read."""
        if not tags:
            raise RegistryError("search needs at least one tag KEY=VALUE")
        if len(tags) > MAX_SEARCH_TAGS:
            raise RegistryError(f"search takes at most {MAX_SEARCH_TAGS} tags (got {len(tags)})")
        check_tags(tags)
        if namespace:
            parse_name(f"{namespace}/x")
        query = select(versions, models.c.namespace, models.c.name).join(models, models.c.id == versions.c.model_id)
        for i, (key, value) in enumerate(sorted(tags.items())):
            t = version_tags.alias(f"t{i}")
            query = query.join(t, and_(t.c.version_id == versions.c.id, t.c.key == key, t.c.value == str(value)))
        if namespace:
            query = query.where(models.c.namespace == namespace)
        query = query.order_by(versions.c.created_s.desc(), versions.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            rows = [r for r in conn.execute(query).all() if self.actor.role_on(r.namespace, r.name)]
            all_tags = self._tags(conn, [r.id for r in rows])
        return [_version_info(f"{r.namespace}/{r.name}", r, all_tags[r.id]) for r in rows]

    def set_tags(self, ref_text: str, tags: dict[str, str]) -> VersionInfo:
        """Add or replace tags on a version (tags are labels; the artifact stays immutable); writer."""
        ref = parse_ref(ref_text)
        self.actor.require("writer", ref.namespace, ref.name, "tag a version")
        check_tags(tags)
        info = self.get_version(ref_text)
        with self.engine.begin() as conn:
            model_id = self._model_id(conn, ref.namespace, ref.name)
            row = self._version_row(conn, model_id, ref, info.version)
            for key, value in tags.items():
                conn.execute(version_tags.delete().where(and_(version_tags.c.version_id == row.id, version_tags.c.key == key)))
                conn.execute(insert(version_tags).values(version_id=row.id, key=key, value=str(value)))
        return self.get_version(f"{ref.full_name}@{info.version}")

    def record_measurement(self, ref_text: str, measurement: evidence.Measurement) -> VersionInfo:
        """Record what an evaluation measured on a version, as ``measured`` by the caller; writer.

        The measurement must name the version's manifest (the weights it measured); a
        measured metric replaces a figure of the same name, whose value and source are kept
        in the new record's ``replaced``.
        """
        ref = parse_ref(ref_text)
        self.actor.require("writer", ref.namespace, ref.name, "record a measurement")
        info = self.get_version(ref_text)
        if measurement.manifest_sha256 != info.manifest_sha256:
            raise RegistryError(f"the measurement was made on manifest {measurement.manifest_sha256[:12]}..., not on "
                                f"{info.name} v{info.version} ({info.manifest_sha256[:12]}...); nothing recorded")
        metrics, sources = dict(info.metrics), dict(info.metric_sources)
        for name, record in measurement.sources(self.actor.name).items():
            if name in metrics:
                record["replaced"] = {"value": metrics[name], "source": evidence.source_of(sources, name)}
            metrics[name], sources[name] = measurement.metrics[name], record
        with self.engine.begin() as conn:
            model_id = self._model_id(conn, ref.namespace, ref.name)
            row = self._version_row(conn, model_id, ref, info.version)
            conn.execute(update(versions).where(versions.c.id == row.id).values(metrics=metrics, metric_sources=sources))
        return self.get_version(f"{info.name}@{info.version}")

    def pull(self, ref_text: str, framework: str | None, fmt: str = "safetensors", out_dir: str | None = None,
             key: str | None = None) -> dict[str, Any]:  # fmt: skip
        """Verify a version completely, then write its weights for ``framework`` as ``fmt``; reader."""
        info = self.resolve_version(ref_text, key)
        manifest, state, groups = artifacts.read_version(self.store, info.manifest_path, info.manifest_sha256)
        out = out_dir or f"{info.name.split('/')[-1]}-v{info.version}"
        framework = artifacts.pull_framework(info, framework)
        path = artifacts.export_weights(manifest, state, groups, framework, fmt, out)
        return {"name": info.name, "version": info.version, "path": str(path), "framework": framework, "format": fmt}

    def resolve_version(self, ref_text: str, key: str | None = None) -> VersionInfo:
        """`get_version`, with a gray-release alias resolved for ``key``."""
        number = self.resolve(ref_text, key)["version"]
        ref = parse_ref(ref_text)
        return self.get_version(f"{ref.full_name}@{number}")

    # ------------------------------------------------------------------ aliases (see `aliases`)
    def resolve(self, ref_text: str, key: str | None = None) -> dict[str, Any]:
        from hybridfleet.registry import aliases as a

        return a.resolve(self, ref_text, key)

    def move_alias(self, name: str, alias: str, version: int, reason: str = "", expect_revision: int | None = None) -> dict[str, Any]:
        from hybridfleet.registry import aliases as a

        return a.move_alias(self, name, alias, version, reason, expect_revision)

    def protect_alias(self, name: str, alias: str, protected: bool = True) -> dict[str, Any]:
        from hybridfleet.registry import aliases as a

        return a.protect_alias(self, name, alias, protected)

    def rollout(self, name: str, alias: str, canary: int | None = None, weight: float | None = None,
                promote: bool = False, rollback: bool = False, reason: str = "") -> dict[str, Any]:  # fmt: skip
        from hybridfleet.registry import aliases as a

        return a.rollout(self, name, alias, canary, weight, promote, rollback, reason)

    def history(self, name: str, alias: str | None = None) -> list[dict[str, Any]]:
        from hybridfleet.registry import aliases as a

        return a.history(self, name, alias)

    def promote(self, name: str, version: int | str, alias: str, require: list[str], no_regression_vs: str | None = None,
                tolerance: float = 0.0, reason: str = "", trust_claimed: bool = False,
                measurement: evidence.Measurement | dict | None = None) -> dict[str, Any]:  # fmt: skip
        from hybridfleet.registry import aliases as a

        return a.promote(self, name, version, alias, require, no_regression_vs, tolerance, reason, trust_claimed,
                         measurement)  # fmt: skip

    def with_source_check(self, check: Callable[[str], None]) -> Registry:
        """This registry (same engine and store), calling ``check(url)`` before any registration reads ``url``."""
        import copy

        other = copy.copy(self)
        other.source_check = check
        return other

    def for_token(self, token: str) -> Registry:
        """This registry (same engine and store) acting for ``token``'s principal.

        Never the local owner: an empty token is an AuthError, as is an unknown one.
        """
        import copy

        if not token:
            raise AuthError("missing token: send Authorization: Bearer <token>")
        other = copy.copy(self)
        other.actor = self.authenticate(token)
        return other

    # ------------------------------------------------------------------ principals and grants
    def add_principal(self, name: str, kind: str = "user", ttl: str | None = None) -> str:
        """Create a user or service account; returns its token (shown once), valid for ``ttl``
        (``30d``, ``12h`` ...; None: no expiry). Admin on ``*``."""
        auth.check_principal_name(name)
        if kind not in auth.KINDS:
            raise RegistryError(f"kind must be one of {auth.KINDS} (got {kind!r})")
        lifetime = auth.parse_ttl(ttl)
        self.actor.require("admin", "*", None, "create principals")
        token, digest = auth.new_token()
        now = time.time()
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(principals).values(name=name, kind=kind, token_sha256=digest, created_s=now,
                                                       expires_s=None if lifetime is None else now + lifetime))  # fmt: skip
        except IntegrityError as err:
            raise RegistryError(f"principal {name!r} exists already") from err
        return token

    def rotate_token(self, name: str, ttl: str | None = None, keep_old: bool = False) -> str:
        """A new token for ``name`` (shown once), valid for ``ttl``; the old one stops working at
        once unless ``keep_old`` (then it stays valid until its own expiry; an older kept one
        is dropped). Admin on ``*`` (a principal cannot renew itself: expiry would mean nothing)."""
        auth.check_principal_name(name)
        lifetime = auth.parse_ttl(ttl)
        self.actor.require("admin", "*", None, "issue tokens")
        token, digest = auth.new_token()
        now = time.time()
        with self.engine.begin() as conn:
            row = conn.execute(select(principals).where(principals.c.name == name)).first()
            if row is None:
                raise RegistryNotFoundError(f"no principal {name!r}")
            conn.execute(update(principals).where(principals.c.name == name).values(
                token_sha256=digest, expires_s=None if lifetime is None else now + lifetime,
                previous_token_sha256=row.token_sha256 if keep_old else None,
                previous_expires_s=row.expires_s if keep_old else None))  # fmt: skip
        return token

    def remove_principal(self, name: str) -> None:
        """Delete a principal and its grants: its token stops working at once. Admin on ``*``."""
        auth.check_principal_name(name)
        self.actor.require("admin", "*", None, "remove principals")
        with self.engine.begin() as conn:
            conn.execute(grants.delete().where(grants.c.principal == name))
            if conn.execute(principals.delete().where(principals.c.name == name)).rowcount != 1:
                raise RegistryNotFoundError(f"no principal {name!r}")

    def grant(self, principal: str, role: str, scope: str) -> dict[str, str]:
        """Give ``principal`` ``role`` on ``scope`` (``*``, NAMESPACE or NAMESPACE/NAME); admin on that scope."""
        auth.check_role(role)
        auth.check_principal_name(principal)
        namespace, _, short = scope.partition("/")
        if scope != "*":
            parse_name(scope if short else f"{scope}/x")
        self.actor.require("admin", namespace, short or None, f"grant roles on {scope}")
        with self.engine.begin() as conn:
            if conn.execute(select(principals.c.name).where(principals.c.name == principal)).scalar() is None:
                raise RegistryNotFoundError(f"no principal {principal!r}; create it with `hfleet registry principal add`")
            conn.execute(grants.delete().where(and_(grants.c.principal == principal, grants.c.scope == scope)))
            conn.execute(insert(grants).values(principal=principal, scope=scope, role=role))
        return {"principal": principal, "role": role, "scope": scope}

    def whoami(self) -> dict[str, Any]:
        return {"name": self.actor.name, "grants": self.actor.grants, "owner": self.actor.owner,
                "token_expires_s": self.actor.expires_s}  # fmt: skip

