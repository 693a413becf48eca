"""Principals with tokens, role grants per namespace/model, protected aliases.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "principals",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created_s", sa.Float, nullable=False),
    )
    op.create_table(
        "grants",
        sa.Column("principal", sa.String(128), sa.ForeignKey("principals.name"), primary_key=True),
        sa.Column("scope", sa.String(260), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
    )
    with op.batch_alter_table("aliases") as batch:
        batch.add_column(sa.Column("protected", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("aliases") as batch:
        batch.drop_column("protected")
    op.drop_table("grants")
    op.drop_table("principals")
