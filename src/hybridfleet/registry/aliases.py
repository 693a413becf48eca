"""Aliases (``prod``, ``staging`` ...), their append-only history, gray release and the promotion gate.

Every change of an alias bumps its ``revision`` with a compare-and-set UPDATE and appends one
history row in the same transaction: of two concurrent moves one wins and the other gets a
ConflictError, and the history stays a chain (each row's ``from`` is the previous ``to``).

Gray release: an alias holds a stable ``version`` and optionally a ``canary_version`` with a
weight in percent. `resolve` with a key hashes (model, alias, key) to a bucket in 0..9999;
buckets below ``weight * 100`` get the canary. A key's bucket never changes, so while the
weight only grows a key that reached the canary stays on it (sticky).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, and_, insert, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from hybridfleet.errors import (
    ConflictError,
    GateFailedError,
    RegistryError,
    RegistryNotFoundError,
)
from hybridfleet.registry import gate
from hybridfleet.registry.evidence import Measurement
from hybridfleet.registry.refs import ModelRef, check_alias, check_text, parse_name, parse_ref
from hybridfleet.registry.schema import alias_events, aliases, versions

if TYPE_CHECKING:
    from hybridfleet.registry.service import Registry

BUCKETS = 10_000
PROTECTED_BY_DEFAULT = ("prod",)


def bucket(full_name: str, alias: str, key: str) -> int:
    """The key's fixed bucket in 0..9999 for this model's alias."""
    digest = hashlib.sha256(f"{full_name}@{alias}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def _alias_row(conn: Connection, model_id: int, alias: str) -> Any:
    return conn.execute(select(aliases).where(and_(aliases.c.model_id == model_id, aliases.c.alias == alias))).first()


def resolve_number(conn: Connection, model_id: int, ref: ModelRef, key: str | None) -> int:
    """The version number ``ref`` names (newest when it names neither alias nor version)."""
    if ref.version is not None:
        return ref.version
    if ref.alias is None:
        newest = conn.execute(select(versions.c.version).where(versions.c.model_id == model_id)
                              .order_by(versions.c.version.desc()).limit(1)).scalar()  # fmt: skip
        if newest is None:
            raise RegistryNotFoundError(f"model {ref.full_name} has no versions yet")
        return newest
    row = _alias_row(conn, model_id, ref.alias)
    if row is None:
        raise RegistryNotFoundError(f"model {ref.full_name} has no alias {ref.alias!r}")
    if key is not None and row.canary_version is not None and bucket(ref.full_name, ref.alias, key) < round(row.canary_weight * 100):
        return row.canary_version
    return row.version


def resolve(reg: Registry, ref_text: str, key: str | None = None) -> dict[str, Any]:
    """``{"name", "version", "alias", "canary"}`` for a reference; with ``key``, gray release applies. Reader."""
    ref = parse_ref(ref_text)
    reg.actor.require("reader", ref.namespace, ref.name, "resolve versions")
    with reg.engine.connect() as conn:
        model_id = reg._model_id(conn, ref.namespace, ref.name)
        number = resolve_number(conn, model_id, ref, key)
        if ref.version is not None:
            reg._version_row(conn, model_id, ref, number)
        row = _alias_row(conn, model_id, ref.alias) if ref.alias else None
    return {"name": ref.full_name, "version": number, "alias": ref.alias,
            "canary": bool(row is not None and row.canary_version == number and row.version != number)}  # fmt: skip


def _required_role(row: Any, alias: str) -> str:
    protected = row.protected if row is not None else alias in PROTECTED_BY_DEFAULT
    return "releaser" if protected else "writer"


def _change(reg: Registry, name: str, alias: str, action: str, reason: str, expect_revision: int | None,
            compute: Any) -> dict[str, Any]:  # fmt: skip
    """Apply ``compute(row) -> new column values`` to an alias with compare-and-set, plus one history row."""
    namespace, short = parse_name(name)
    check_alias(alias)
    check_text(reason, "reason")
    ref = ModelRef(namespace, short)
    try:
        with reg.engine.begin() as conn:
            model_id = reg._model_id(conn, namespace, short)
            row = _alias_row(conn, model_id, alias)
            reg.actor.require(_required_role(row, alias), namespace, short,
                              f"{action} {'protected ' if _required_role(row, alias) == 'releaser' else ''}alias {alias!r}")
            if expect_revision is not None and (row.revision if row is not None else 0) != expect_revision:
                raise ConflictError(f"alias {alias!r} of {ref.full_name} is at revision "
                                    f"{row.revision if row is not None else 0}, not {expect_revision}; nothing changed")
            values = compute(row)
            for number in {values.get("version"), values.get("canary_version")} - {None}:
                reg._version_row(conn, model_id, ref, number)
            if row is None:
                revision = 1
                conn.execute(insert(aliases).values(model_id=model_id, alias=alias, revision=revision,
                                                    protected=alias in PROTECTED_BY_DEFAULT,
                                                    **{"canary_version": None, "canary_weight": 0.0, **values}))  # fmt: skip
            else:
                revision = row.revision + 1
                done = conn.execute(update(aliases).where(and_(aliases.c.model_id == model_id, aliases.c.alias == alias,
                                                               aliases.c.revision == row.revision))
                                    .values(revision=revision, **values))  # fmt: skip
                if done.rowcount != 1:
                    raise ConflictError(f"alias {alias!r} of {ref.full_name} was changed concurrently; nothing changed")
            after = _alias_row(conn, model_id, alias)
            conn.execute(insert(alias_events).values(
                model_id=model_id, alias=alias, action=action, from_version=row.version if row is not None else None,
                to_version=after.version, canary_version=after.canary_version, canary_weight=after.canary_weight,
                revision=revision, actor=reg.actor.name, reason=reason, at_s=time.time()))  # fmt: skip
    except (IntegrityError, OperationalError) as err:
        if isinstance(err, OperationalError) and "locked" not in str(err):
            raise
        raise ConflictError(f"alias {alias!r} of {ref.full_name} was changed concurrently; nothing changed") from err
    return describe_alias(after, ref.full_name)


def describe_alias(row: Any, full_name: str) -> dict[str, Any]:
    return {"name": full_name, "alias": row.alias, "version": row.version, "canary_version": row.canary_version,
            "canary_weight": row.canary_weight, "revision": row.revision, "protected": row.protected}  # fmt: skip


def move_alias(reg: Registry, name: str, alias: str, version: int, reason: str = "",
               expect_revision: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Point ``alias`` at ``version`` (ending any canary). Writer; releaser for a protected alias."""
    return _change(reg, name, alias, "move", reason, expect_revision,
                   lambda row: {"version": version, "canary_version": None, "canary_weight": 0.0})


def protect_alias(reg: Registry, name: str, alias: str, protected: bool = True) -> dict[str, Any]:
    """Mark an existing alias protected (only releasers move it) or not. Admin."""
    namespace, short = parse_name(name)
    reg.actor.require("admin", namespace, short, f"change the protection of alias {alias!r}")
    with reg.engine.begin() as conn:
        model_id = reg._model_id(conn, namespace, short)
        row = _alias_row(conn, model_id, alias)
        if row is None:
            raise RegistryNotFoundError(f"model {namespace}/{short} has no alias {alias!r}")
        conn.execute(update(aliases).where(and_(aliases.c.model_id == model_id, aliases.c.alias == alias))
                     .values(protected=protected, revision=row.revision + 1))  # fmt: skip
        conn.execute(insert(alias_events).values(
            model_id=model_id, alias=alias, action="protect" if protected else "unprotect", from_version=row.version,
            to_version=row.version, canary_version=row.canary_version, canary_weight=row.canary_weight,
            revision=row.revision + 1, actor=reg.actor.name, reason="", at_s=time.time()))  # fmt: skip
        return describe_alias(_alias_row(conn, model_id, alias), f"{namespace}/{short}")


def rollout(reg: Registry, name: str, alias: str, canary: int | None = None, weight: float | None = None,
            promote: bool = False, rollback: bool = False, reason: str = "") -> dict[str, Any]:  # fmt: skip
    """Gray release on an alias: start or reweight a canary, promote it, or roll it back (one per call)."""
    if sum([canary is not None or weight is not None, promote, rollback]) != 1:
        raise RegistryError("rollout takes exactly one of: --canary VERSION --weight W, --weight W, --promote, --rollback")
    if weight is not None and not 0 <= weight <= 100:
        raise RegistryError(f"--weight is a percentage in 0..100 (got {weight})")

    def compute(row: Any) -> dict[str, Any]:
        if row is None:
            raise RegistryNotFoundError(f"alias {alias!r} does not exist yet; point it at a stable version first "
                                        f"(`hfleet registry alias {name} {alias} VERSION`)")
        if promote or rollback:
            if row.canary_version is None:
                raise RegistryError(f"alias {alias!r} has no canary to {'promote' if promote else 'roll back'}")
            return {"version": row.canary_version if promote else row.version, "canary_version": None, "canary_weight": 0.0}
        target = canary if canary is not None else row.canary_version
        if target is None:
            raise RegistryError(f"alias {alias!r} has no canary; give --canary VERSION")
        if target == row.version:
            raise RegistryError(f"version {target} is already the stable version of {alias!r}")
        return {"version": row.version, "canary_version": target, "canary_weight": float(weight if weight is not None else 0.0)}

    action = "promote" if promote else "rollback" if rollback else "canary"
    return _change(reg, name, alias, action, reason, None, compute)


def history(reg: Registry, name: str, alias: str | None = None) -> list[dict[str, Any]]:
    """Every change of the model's aliases (or of one), oldest first. Reader."""
    namespace, short = parse_name(name)
    reg.actor.require("reader", namespace, short, "read alias history")
    with reg.engine.connect() as conn:
        model_id = reg._model_id(conn, namespace, short)
        query = select(alias_events).where(alias_events.c.model_id == model_id)
        if alias:
            check_alias(alias)
            query = query.where(alias_events.c.alias == alias)
        rows = conn.execute(query.order_by(alias_events.c.id)).all()
    return [{"alias": r.alias, "action": r.action, "from_version": r.from_version, "to_version": r.to_version,
             "canary_version": r.canary_version, "canary_weight": r.canary_weight, "revision": r.revision,
             "actor": r.actor, "reason": r.reason, "at_s": r.at_s} for r in rows]  # fmt: skip


def promote(reg: Registry, name: str, version: int | str, alias: str, require: list[str], no_regression_vs: str | None = None,
            tolerance: float = 0.0, reason: str = "", trust_claimed: bool = False,
            measurement: Measurement | dict | None = None) -> dict[str, Any]:  # fmt: skip
    """Move ``alias`` to ``version`` (a number, or an alias naming the candidate) only if the gate passes.

    GateFailedError (with machine-readable reasons) otherwise.

    The gate reads the version's evidence: the checkpoint's own metrics and what a gate
    measured (``measurement``, from `hybridfleet.registry.evaluate.measure`, is recorded on
    the version first, as measured by the caller, even when the gate then refuses); a
    claimed metric fails unless ``trust_claimed``. Permission and parse errors come first,
    so a gate never runs for a caller who could not move the alias anyway. The alias does
    not change unless every check passes. ``checked`` in the result is False when no
    requirement was given: then nothing was judged.
    """
    namespace, short = parse_name(name)
    check_alias(alias)
    check_text(reason, "reason")
    requirements = [gate.parse_requirement(text) for text in require]
    if isinstance(measurement, dict):
        measurement = Measurement.from_dict(measurement)
    with reg.engine.connect() as conn:
        model_id = reg._model_id(conn, namespace, short)
        row = _alias_row(conn, model_id, alias)
    reg.actor.require(_required_role(row, alias), namespace, short, f"move alias {alias!r}")
    candidate = reg.get_version(f"{namespace}/{short}@{version}")
    if measurement is not None:
        candidate = reg.record_measurement(f"{namespace}/{short}@{candidate.version}", measurement)
    baseline = None
    if no_regression_vs:
        try:
            baseline = reg.get_version(f"{namespace}/{short}@{no_regression_vs}")
        except RegistryNotFoundError:
            baseline = None  # the first promotion: nothing to regress from
    checks = gate.evaluate(candidate.metrics, requirements, baseline.metrics if baseline else None,
                           f"{no_regression_vs} (v{baseline.version})" if baseline else "", tolerance,
                           candidate.metric_sources, baseline.metric_sources if baseline else None, trust_claimed)  # fmt: skip
    version = candidate.version
    result = {"name": f"{namespace}/{short}", "version": version, "alias": alias, "checked": bool(requirements),
              "passed": all(c.passed for c in checks), "checks": [c.to_dict() for c in checks],
              "measured": measurement.to_dict() if measurement is not None else None}  # fmt: skip
    if not result["passed"]:
        failed = "; ".join(c.reason for c in checks if not c.passed)
        raise GateFailedError(f"gate refused {namespace}/{short} v{version} for {alias!r}: {failed}", result["checks"])
    gate_text = (f"promoted through gate: {', '.join(str(r) for r in requirements)}" if requirements
                 else "moved by promote with no requirement given (nothing checked)")  # fmt: skip
    moved = move_alias(reg, name, alias, version, reason=reason or gate_text,
                       expect_revision=row.revision if row is not None else 0)
    return {**result, "alias_state": moved}
