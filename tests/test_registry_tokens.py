"""Registry tokens with an expiry and rotation: expired tokens get 401 with a message, a rotation
revokes the old token unless told to keep it, and a database at the previous schema migrates with
its tokens still valid. SQLite and PostgreSQL; over real HTTP where the status code matters."""

from __future__ import annotations

import time

import httpx
import pytest

from hybridfleet.errors import AuthError, PermissionDeniedError, RegistryError
from hybridfleet.registry import Registry, db
from hybridfleet.registry.schema import principals
from tests.registry_helpers import table_counts
from tests.test_registry_server import Server, cli

pytest_plugins = ["tests.registry_fixtures"]
HTTP = httpx.Client(timeout=120)  # generous: the machine may be busy; no figure is timed here


def _expire(reg: Registry, name: str, column: str = "expires_s") -> None:
    """Move a token's expiry into the past (what waiting 30 days would do)."""
    with reg.engine.begin() as conn:
        conn.execute(principals.update().where(principals.c.name == name).values({column: time.time() - 1}))


def test_an_expired_token_is_401_with_a_message_and_changes_nothing(registry):
    token = registry.add_principal("ci", "service", ttl="30d")
    registry.grant("ci", "admin", "*")
    ci = registry.for_token(token)
    assert 29 * 86400 < ci.whoami()["token_expires_s"] - time.time() <= 30 * 86400
    _expire(registry, "ci")
    before = table_counts(registry)
    with pytest.raises(AuthError, match=r"registry token of ci expired at .*`hfleet registry principal token ci --ttl 30d`"):
        registry.for_token(token)
    with Server(registry) as server:
        response = HTTP.post(f"{server.url}/api/v1/principals", json={"name": "mallory"},
                              headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        assert response.status_code == 401 and response.json()["error"] == "auth"
        assert "expired at" in response.json()["detail"]
    assert table_counts(registry) == before


def test_rotation_revokes_the_old_token_unless_kept_and_only_an_admin_rotates(registry):
    old = registry.add_principal("ci", "service")
    new = registry.rotate_token("ci", ttl="12h")
    with pytest.raises(AuthError, match="not valid"):
        registry.for_token(old)
    assert registry.for_token(new).whoami()["name"] == "ci"
    newer = registry.rotate_token("ci", ttl="1h", keep_old=True)
    assert registry.for_token(new).whoami()["name"] == registry.for_token(newer).whoami()["name"] == "ci"
    _expire(registry, "ci", "previous_expires_s")
    with pytest.raises(AuthError, match="expired at"):
        registry.for_token(new)  # the kept token ends at its own expiry
    assert registry.for_token(newer).whoami()["name"] == "ci"
    before = table_counts(registry)
    with pytest.raises(PermissionDeniedError, match="ci needs role 'admin' on namespace \\*"):
        registry.for_token(newer).rotate_token("ci", ttl="3650d")  # a token cannot renew itself
    for ttl in ("30", "0d", "-1d", "30d\n", "99999d", "1y"):
        with pytest.raises(RegistryError, match="ttl"):
            registry.rotate_token("ci", ttl=ttl)
    with pytest.raises(RegistryError, match="ttl"):
        registry.add_principal("bob", ttl="forever")
    assert table_counts(registry) == before and registry.for_token(newer).whoami()["name"] == "ci"


def test_cli_issues_tokens_with_a_ttl(registry, db_url):
    code, out = cli("registry", "principal", "add", "ann", "--ttl", "30d", "--registry", db_url)
    assert code == 0
    first = out.strip()
    code, out = cli("registry", "principal", "token", "ann", "--ttl", "12h", "--keep-old", "--registry", db_url)
    assert code == 0
    second = out.strip()
    assert registry.for_token(first).whoami()["name"] == registry.for_token(second).whoami()["name"] == "ann"
    code, _ = cli("registry", "principal", "token", "ann", "--ttl", "12x", "--registry", db_url)
    assert code != 0 and registry.for_token(second).whoami()["token_expires_s"] is not None


def test_a_database_at_the_previous_schema_migrates_and_its_tokens_stay_valid(db_url, tmp_path):
    engine = db.make_engine(db_url)
    db.upgrade(engine, "0002")
    with engine.begin() as conn:
        from hybridfleet.registry.auth import new_token

        token, digest = new_token()
        conn.exec_driver_sql("INSERT INTO principals (name, kind, token_sha256, created_s) VALUES ('old', 'user', "
                             f"'{digest}', 0)")  # fmt: skip
    db.upgrade(engine)
    reg = Registry(db_url, store=str(tmp_path / "a"))
    assert reg.for_token(token).whoami() == {"name": "old", "grants": {}, "owner": False, "token_expires_s": None}


def test_rotation_over_rest_needs_admin_and_bad_names_are_refused(registry):
    from hybridfleet.registry.client import RemoteRegistry

    admin_token = registry.add_principal("boss")
    registry.grant("boss", "admin", "*")
    ci_token = registry.add_principal("ci", "service")
    with Server(registry) as server:
        boss, ci = RemoteRegistry(server.url, admin_token), RemoteRegistry(server.url, ci_token)
        before = table_counts(registry)
        with pytest.raises(PermissionDeniedError, match="needs role 'admin' on namespace \\*"):
            ci.rotate_token("ci", ttl="3650d")
        with pytest.raises(RegistryError, match="principal name 'ci\\\\x00'"):
            boss.rotate_token("ci\x00")
        with pytest.raises(RegistryError, match="principal name"):
            boss.remove_principal("ci\n")
        assert table_counts(registry) == before and ci.whoami()["name"] == "ci"
        fresh = boss.rotate_token("ci", ttl="1h")
        with pytest.raises(AuthError, match="not valid"):
            ci.whoami()
        assert RemoteRegistry(server.url, fresh).whoami()["token_expires_s"] is not None
