"""Tokens with an expiry, and a second (previous) token kept through a rotation.

Revision ID: 0004
Revises: 0003_metric_sources
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003_metric_sources"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing tokens keep working: no expiry (NULL), no previous token.
    with op.batch_alter_table("principals", recreate="never") as batch:
        batch.add_column(sa.Column("expires_s", sa.Float, nullable=True))
        batch.add_column(sa.Column("previous_token_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("previous_expires_s", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("principals") as batch:
        batch.drop_column("previous_expires_s")
        batch.drop_column("previous_token_sha256")
        batch.drop_column("expires_s")
