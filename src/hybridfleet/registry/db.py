"""Opening the registry database: SQLite by default, PostgreSQL by URL; schema checked on open.

A new, empty database is created at the newest schema. A database at an older schema
is refused with the command that migrates it (`hfleet registry migrate --db URL`):
migrating is an explicit step, because an older hfleet may still be using it.
"""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, inspect

from hybridfleet.errors import RegistryError, SchemaError
from hybridfleet.paths import state_dir

MIGRATIONS = Path(__file__).parent / "migrations"
DB_ENV = "HFLEET_REGISTRY"


def default_db_url() -> str:
    """``$HFLEET_REGISTRY`` (when it names a database, not a server), else SQLite at the project's
    ``.hfleet/registry/registry.db`` (`hybridfleet.paths`)."""
    if os.environ.get(DB_ENV) and not os.environ[DB_ENV].startswith(("http://", "https://")):
        return os.environ[DB_ENV]
    path = state_dir() / "registry" / "registry.db"
    return f"sqlite:///{path}"


def normalize_url(url: str) -> str:
    """A SQLAlchemy URL: ``postgresql://`` uses psycopg 3; a bare path means SQLite."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    if not url.startswith(("sqlite:", "postgresql+")):
        raise RegistryError(f"registry database URL must be sqlite:///PATH or postgresql://... (got {url!r})")
    return url


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and foreign keys."""
    url = normalize_url(url)
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {},
                           pool_pre_ping=not url.startswith("sqlite"))  # fmt: skip
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
    return engine


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def head_revision() -> str:
    """The schema revision this hfleet writes."""
    return ScriptDirectory.from_config(_alembic_config()).get_current_head() or ""


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision (None for a database alembic never touched)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database to ``revision`` (default: the newest) in one transaction."""
    config = _alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def check_schema(engine: Engine, url: str, create: bool = True) -> None:
    """Create an empty database at the newest schema, pass a current one, refuse any other."""
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return
    if current is None:
        tables = inspect(engine).get_table_names()
        if tables:
            raise SchemaError(f"{url}: has tables {tables[:5]} but no registry schema version; not a registry database")
        if not create:
            raise SchemaError(f"{url}: no registry here; create it with `hfleet registry init --db {url}`")
        upgrade(engine)
        return
    known = {s.revision for s in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}
    if current not in known:
        raise SchemaError(f"{url}: schema revision {current} is newer than this hfleet ({head}); upgrade hybridfleet")
    raise SchemaError(f"{url}: schema revision {current} is older than this hfleet's {head}; "
                      f"run `hfleet registry migrate --db {url}` (back it up first)")
