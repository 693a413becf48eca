"""The registry REST server refuses hostile input with a 4xx in its JSON error shape and changes nothing:
look-alike names with a trailing newline, the existence oracle, forged history lines, inputs that
used to end in HTTP 500, and checkpoint paths that leave the allowed folders (MODEL.json targets,
symbolic links). Real uvicorn on 127.0.0.1, SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from hybridfleet.errors import RegistryError
from hybridfleet.registry import Registry
from hybridfleet.registry.schema import alias_events
from hybridfleet.registry.server import create_app
from tests.registry_helpers import files_under, save_model, table_counts
from tests.test_registry_server import Server, cli

pytest_plugins = ["tests.registry_fixtures"]
HTTP = httpx.Client(timeout=120)  # generous: the machine may be busy; no figure is timed here
pytestmark = pytest.mark.torch  # the versions are torch checkpoints (tests/registry_helpers.save_model)


@pytest.fixture
def live(db_url, tmp_path):
    """(owner, server url, headers by principal): ci writer on ci + releaser on ci/digits, eve has no role."""
    owner = Registry(db_url, store=str(tmp_path / "artifacts"))
    tokens = {"ci": owner.add_principal("ci", "service"), "eve": owner.add_principal("eve")}
    owner.grant("ci", "writer", "ci")
    owner.grant("ci", "releaser", "ci/digits")
    save_model(tmp_path / "run", test_accuracy=0.97)
    owner.register("ci/digits", str(tmp_path / "run"))
    owner.move_alias("ci/digits", "prod", 1)
    server = Server(owner)
    server.server.config.app = create_app(owner, [owner.store_url, f"file://{(tmp_path / 'allowed').resolve()}"])
    with server:
        yield owner, server.url, {n: {"Authorization": f"Bearer {t}"} for n, t in tokens.items()}


def _refused(response: httpx.Response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) >= {"error", "detail"} and isinstance(body["detail"], str), body
    for fragment in fragments:
        assert fragment in body["detail"], (fragment, body["detail"])
    return body


def test_a_trailing_newline_never_names_another_alias_model_or_principal(live):
    owner, url, h = live
    before, aliases_before = table_counts(owner), owner.resolve("ci/digits@prod")
    _refused(HTTP.put(f"{url}/api/v1/models/ci/digits/aliases/prod%0A", json={"version": 1}, headers=h["ci"]), 400,
             "alias 'prod\\n'")
    _refused(HTTP.post(f"{url}/api/v1/models", json={"name": "ci/digits\n"}, headers=h["ci"]), 400, "model name 'digits\\n'")
    _refused(HTTP.get(f"{url}/api/v1/resolve", params={"ref": "ci/digits@prod\n"}, headers=h["ci"]), 400, "alias 'prod\\n'")
    _refused(HTTP.get(f"{url}/api/v1/resolve", params={"ref": "ci/digits@1\n"}, headers=h["ci"]), 400)
    with pytest.raises(RegistryError, match="principal name 'ann\\\\n'"):
        owner.add_principal("ann\n")
    assert table_counts(owner) == before and owner.resolve("ci/digits@prod") == aliases_before


def test_a_caller_without_a_role_gets_one_answer_for_existing_and_missing_models(live):
    _owner, url, h = live
    for method, path, body in [("GET", "/models/ci/{m}/versions", None), ("GET", "/models/ci/{m}/history", None),
                               ("PUT", "/models/ci/{m}/aliases/staging", {"version": 1}),
                               ("POST", "/models/ci/{m}/promote", {"version": 1, "alias": "prod"})]:
        answers = []
        for model in ("digits", "nope"):
            response = HTTP.request(method, url + "/api/v1" + path.format(m=model), json=body, headers=h["eve"])
            answers.append((response.status_code, response.json()["error"], response.json()["detail"].replace(model, "M")))
        assert answers[0] == answers[1] == (404, "registry_not_found", "no model ci/M in this registry (or no permission to see it)")
    for ref in ("ci/digits@prod", "ci/nope@prod", "ci/digits@1", "ci/nope@1"):
        response = HTTP.get(f"{url}/api/v1/resolve", params={"ref": ref}, headers=h["eve"])
        assert response.status_code == 404 and "(or no permission to see it)" in response.json()["detail"]
    # a caller with a role on the namespace still learns what it lacks
    response = HTTP.put(f"{url}/api/v1/models/ci/digits/aliases/prod", json={"version": 1}, headers=h["ci"])
    assert response.status_code == 200


def test_a_multi_line_reason_is_refused_and_stored_ones_print_escaped(live, db_url):
    owner, url, h = live
    before, history_before = table_counts(owner), owner.history("ci/digits")
    forged = "ok\n2026-12-01 10:00:00Z  prod       move      v1 -> v9  by admin  approved"
    for reason in (forged, "ok\rprod", "colour \x1b[31mred", "a\u2028b"):
        _refused(HTTP.put(f"{url}/api/v1/models/ci/digits/aliases/staging", json={"version": 1, "reason": reason},
                           headers=h["ci"]), 400, "control characters")
        _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/aliases/prod/rollout",
                            json={"canary": 1, "weight": 5, "reason": reason}, headers=h["ci"]), 400, "control characters")
        _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/promote", json={"version": 1, "alias": "prod", "reason": reason},
                            headers=h["ci"]), 400, "control characters")
    assert table_counts(owner) == before and owner.history("ci/digits") == history_before
    # a row written before the check (an older database): printed on one line, escaped
    with owner.engine.begin() as conn:
        conn.execute(alias_events.insert().values(model_id=1, alias="prod", action="move", from_version=1, to_version=1,
                                                  revision=99, actor="old", reason=forged, at_s=0.0))  # fmt: skip
    code, out = cli("registry", "history", "ci/digits", "--registry", db_url)
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == len(history_before) + 1 and lines[-1].endswith("ok\\n2026-12-01 10:00:00Z  prod       move      v1 -> v9  by admin  approved")


def test_inputs_that_ended_in_http_500_are_4xx_with_a_message(live):
    owner, url, h = live
    before, prod = table_counts(owner), owner.resolve("ci/digits@prod")
    big = 2**63
    _refused(HTTP.get(f"{url}/api/v1/version", params={"ref": f"ci/digits@{big}"}, headers=h["ci"]), 400, "version numbers are 1 to")
    _refused(HTTP.get(f"{url}/api/v1/resolve", params={"ref": f"ci/digits@v{big}"}, headers=h["ci"]), 400, "version numbers are 1 to")
    _refused(HTTP.put(f"{url}/api/v1/models/ci/digits/aliases/staging", json={"version": big}, headers=h["ci"]), 422,
             "invalid request: body.version")
    _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/aliases/prod/rollout", json={"canary": big, "weight": 5},
                        headers=h["ci"]), 422, "body.canary")
    _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/versions", json={"checkpoint_url": "x", "step": big},
                        headers=h["ci"]), 422, "body.step")
    _refused(HTTP.get(f"{url}/api/v1/search", params={"tag": [f"k{i}=v" for i in range(70)]}, headers=h["ci"]), 400,
             "search takes at most 16 tags (got 70)")
    _refused(HTTP.get(f"{url}/api/v1/search", params={"tag": ["novalue"]}, headers=h["ci"]), 400, "expected KEY=VALUE")
    _refused(HTTP.get(f"{url}/api/v1/search", params={"tag": ["k=\x00"]}, headers=h["ci"]), 400, "control characters")
    _refused(HTTP.get(f"{url}/api/v1/models", params={"namespace": "a\x00b"}, headers=h["ci"]), 400, "namespace")
    for ref in ("@@", "ci/", "/x", "ci/digits@", "ci/digits@prod@1", "x" * 300):
        _refused(HTTP.get(f"{url}/api/v1/resolve", params={"ref": ref}, headers=h["ci"]), 400)
    _refused(HTTP.post(f"{url}/api/v1/tags", json={"ref": "ci/digits@1", "tags": {"k" * 200: "v"}}, headers=h["ci"]), 400,
             "tag key: at most 128")
    _refused(HTTP.put(f"{url}/api/v1/models/ci/digits/aliases/staging", content=b"{not json", headers=h["ci"]), 422,
             "invalid request")
    _refused(HTTP.put(f"{url}/api/v1/models/ci/digits/aliases/staging", json={"version": 1, "weight": 5},
                       headers=h["ci"]), 422, "body.weight: Extra inputs are not permitted")
    _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/aliases/prod/rollout", content=b'{"weight": NaN}',
                        headers={**h["ci"], "content-type": "application/json"}), 422, "body.weight")
    _refused(HTTP.get(f"{url}/api/v1/nowhere", headers=h["ci"]), 404)
    assert table_counts(owner) == before and owner.resolve("ci/digits@prod") == prod


def test_a_hub_id_with_dot_dot_is_a_registry_error():
    from hybridfleet.registry.hub import parse_source

    for text in ("hf:org/..@main", "hf:../x", "hf:org/a..b", "modelscope:org/x@../../etc", "hf:org/x@main\n", "hf:org/x@/main"):
        with pytest.raises(RegistryError, match="hub source"):
            parse_source(text)
    assert parse_source("hf:org/tiny@v1.0").revision == "v1.0"


def test_register_run_checks_the_model_json_target_against_the_allowed_folders(live, tmp_path):
    from hybridfleet.ckpt.run_model import write_model_card

    owner, url, h = live
    save_model(tmp_path / "secret" / "run", seed=3)
    write_model_card(str(tmp_path / "secret" / "run"), {"job": "x"})
    (tmp_path / "allowed" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "secret" / "run" / "MODEL.json", tmp_path / "allowed" / "run" / "MODEL.json")
    before, blobs = table_counts(owner), files_under(tmp_path / "artifacts")
    body = {"checkpoint_url": str(tmp_path / "allowed" / "run"), "run_model": True}
    _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/versions", json=body, headers=h["ci"]), 400,
             "reads local checkpoints only under")
    assert table_counts(owner) == before and files_under(tmp_path / "artifacts") == blobs


def test_a_symbolic_link_inside_a_checkpoint_is_refused_without_revealing_its_target(live, tmp_path):
    owner, url, h = live
    save_model(tmp_path / "allowed" / "run", seed=4)
    blob = next(p for p in (tmp_path / "allowed" / "run" / "blobs").rglob("*") if p.is_file())
    target = tmp_path / "outside.bin"
    target.write_bytes(b"s" * 12345)
    blob.unlink()
    os.symlink(target, blob)
    before, blobs = table_counts(owner), files_under(tmp_path / "artifacts")
    body = _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/versions", json={"checkpoint_url": str(tmp_path / "allowed" / "run")},
                               headers=h["ci"]), 400, "contains a symbolic link", "does not follow links")  # fmt: skip
    assert "12345" not in json.dumps(body) and "outside" not in json.dumps(body)
    # a linked checkpoint root that resolves outside the allowed folders
    os.symlink(tmp_path / "run", tmp_path / "allowed" / "linked")
    _refused(HTTP.post(f"{url}/api/v1/models/ci/digits/versions", json={"checkpoint_url": str(tmp_path / "allowed" / "linked")},
                        headers=h["ci"]), 400, "reads local checkpoints only under")  # fmt: skip
    assert table_counts(owner) == before and files_under(tmp_path / "artifacts") == blobs
    assert Path(target).read_bytes() == b"s" * 12345
