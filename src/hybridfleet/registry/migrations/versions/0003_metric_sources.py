"""Where each metric of a version comes from: the checkpoint's own record, a writer's claim, or a gate's measurement.

Revision ID: 0003_metric_sources
Revises: 0002

Versions registered before this revision get ``{}``: a metric without a recorded source
counts as claimed, so a gate accepts it only with ``--trust-claimed`` or after measuring it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_metric_sources"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("metric_sources", sa.JSON, nullable=False, server_default=sa.text("'{}'")))


def downgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("metric_sources")
