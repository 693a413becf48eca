"""The registry's tables (SQLAlchemy Core). Alembic migrations under ``migrations/`` create them.

Times are UNIX seconds (float); JSON columns hold metrics, lineage and file lists.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

settings = Table(
    "registry_settings", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)  # fmt: skip

models = Table(
    "models", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("namespace", String(128), nullable=False),
    Column("name", String(128), nullable=False),
    Column("description", Text, nullable=False, default=""),
    Column("created_by", String(128), nullable=False),
    Column("created_s", Float, nullable=False),
    UniqueConstraint("namespace", "name", name="uq_models_namespace_name"),
)  # fmt: skip

versions = Table(
    "versions", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("model_id", Integer, ForeignKey("models.id"), nullable=False),
    Column("version", Integer, nullable=False),
    Column("manifest_path", String(512), nullable=False),
    Column("manifest_sha256", String(64), nullable=False),
    Column("framework", String(16)),
    Column("step", Integer),
    Column("size_bytes", Integer, nullable=False),
    Column("metrics", JSON, nullable=False),
    Column("lineage", JSON, nullable=False),
    Column("metric_sources", JSON, nullable=False, default=dict),  # metric -> provenance; added by 0003_metric_sources
    Column("description", Text, nullable=False, default=""),
    Column("created_by", String(128), nullable=False),
    Column("created_s", Float, nullable=False),
    UniqueConstraint("model_id", "version", name="uq_versions_model_version"),
)  # fmt: skip

version_tags = Table(
    "version_tags", metadata,
    Column("version_id", Integer, ForeignKey("versions.id"), primary_key=True),
    Column("key", String(128), primary_key=True),
    Column("value", String(512), nullable=False),
    Index("ix_version_tags_key_value", "key", "value"),
)  # fmt: skip

aliases = Table(
    "aliases", metadata,
    Column("model_id", Integer, ForeignKey("models.id"), primary_key=True),
    Column("alias", String(64), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("canary_version", Integer),
    Column("canary_weight", Float, nullable=False, default=0.0),
    Column("revision", Integer, nullable=False),  # bumped by every change: optimistic concurrency
    Column("protected", Boolean, nullable=False, default=False),  # added by revision 0002
)  # fmt: skip

alias_events = Table(
    "alias_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("model_id", Integer, ForeignKey("models.id"), nullable=False),
    Column("alias", String(64), nullable=False),
    Column("action", String(32), nullable=False),
    Column("from_version", Integer),
    Column("to_version", Integer),
    Column("canary_version", Integer),
    Column("canary_weight", Float),
    Column("revision", Integer, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("at_s", Float, nullable=False),
    UniqueConstraint("model_id", "alias", "revision", name="uq_alias_events_revision"),
)  # fmt: skip

principals = Table(
    "principals", metadata,
    Column("name", String(128), primary_key=True),
    Column("kind", String(16), nullable=False),  # user | service
    Column("token_sha256", String(64), nullable=False, unique=True),
    Column("created_s", Float, nullable=False),
    # added by revision 0003: the token's expiry (NULL: none), and the token a rotation kept
    Column("expires_s", Float),
    Column("previous_token_sha256", String(64)),
    Column("previous_expires_s", Float),
)  # fmt: skip

grants = Table(
    "grants", metadata,
    Column("principal", String(128), ForeignKey("principals.name"), primary_key=True),
    Column("scope", String(260), primary_key=True),  # "*", "NAMESPACE" or "NAMESPACE/MODEL"
    Column("role", String(16), nullable=False),
)  # fmt: skip
