"""Models, versions, tags, aliases and their history.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("registry_settings", sa.Column("key", sa.String(64), primary_key=True),
                    sa.Column("value", sa.Text, nullable=False))
    op.create_table(
        "models",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("namespace", sa.String(128), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("description", sa.Text, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("created_s", sa.Float, nullable=False),
        sa.UniqueConstraint("namespace", "name", name="uq_models_namespace_name"),
    )
    op.create_table(
        "versions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("manifest_path", sa.String(512), nullable=False),
        sa.Column("manifest_sha256", sa.String(64), nullable=False),
        sa.Column("framework", sa.String(16)),
        sa.Column("step", sa.Integer),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("lineage", sa.JSON, nullable=False),
        sa.Column("description", sa.Text, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("created_s", sa.Float, nullable=False),
        sa.UniqueConstraint("model_id", "version", name="uq_versions_model_version"),
    )
    op.create_table(
        "version_tags",
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), primary_key=True),
        sa.Column("key", sa.String(128), primary_key=True),
        sa.Column("value", sa.String(512), nullable=False),
    )
    op.create_index("ix_version_tags_key_value", "version_tags", ["key", "value"])
    op.create_table(
        "aliases",
        sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), primary_key=True),
        sa.Column("alias", sa.String(64), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("canary_version", sa.Integer),
        sa.Column("canary_weight", sa.Float, nullable=False),
        sa.Column("revision", sa.Integer, nullable=False),
    )
    op.create_table(
        "alias_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), nullable=False),
        sa.Column("alias", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("from_version", sa.Integer),
        sa.Column("to_version", sa.Integer),
        sa.Column("canary_version", sa.Integer),
        sa.Column("canary_weight", sa.Float),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("at_s", sa.Float, nullable=False),
        sa.UniqueConstraint("model_id", "alias", "revision", name="uq_alias_events_revision"),
    )


def downgrade() -> None:
    for table in ("alias_events", "aliases", "version_tags", "versions", "models", "registry_settings"):
        op.drop_table(table)
