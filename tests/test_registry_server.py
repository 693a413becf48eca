"""`hfleet registry serve` over real HTTP (uvicorn on 127.0.0.1), on SQLite and PostgreSQL; the CLI
against it with tokens; exit codes from the errors table; and the CI examples' commands as written."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from hybridfleet.cli.app import main
from hybridfleet.errors import (
    EXIT_CODES,
    GateFailedError,
    PermissionDeniedError,
    RegistryError,
)
from hybridfleet.registry import Registry
from hybridfleet.registry.client import RemoteRegistry
from hybridfleet.registry.server import create_app
from tests.registry_helpers import save_model, table_counts

pytest_plugins = ["tests.registry_fixtures", "tests.seaweed"]
pytestmark = pytest.mark.torch  # the versions are torch checkpoints (tests/registry_helpers.save_model)
REPO = Path(__file__).resolve().parents[1]


class Server:
    """uvicorn serving the registry app in a thread."""

    def __init__(self, registry: Registry):
        import uvicorn

        from hybridfleet.launch.preflight import free_port

        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(registry), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "registry server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def served(db_url, tmp_path):
    """(owner registry, server, tokens by principal) with ci (writer on ci, releaser on ci/digits) and ann (reader)."""
    owner = Registry(db_url, store=str(tmp_path / "artifacts"))
    tokens = {"ci": owner.add_principal("ci", "service"), "ann": owner.add_principal("ann")}
    owner.grant("ci", "writer", "ci")
    owner.grant("ci", "releaser", "ci/digits")
    owner.grant("ann", "reader", "ci")
    with Server(owner) as server:
        yield owner, server, tokens


def cli(*args: str) -> tuple[int, str]:
    """Run `hfleet ARGS` in-process; (exit code, stdout)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(list(args))
            code = 0
        except SystemExit as ex:
            code = int(ex.code or 0)
    return code, out.getvalue()


def test_rest_api_needs_a_token_and_answers_403_with_the_missing_role(served, tmp_path):
    owner, server, tokens = served
    save_model(tmp_path / "run", test_accuracy=0.97)
    owner.register("ci/digits", str(tmp_path / "run"))
    assert httpx.get(f"{server.url}/api/v1/models").status_code == 401
    openapi = httpx.get(f"{server.url}/openapi.json").json()
    assert "/api/v1/resolve" in openapi["paths"] and "/api/v1/models/{namespace}/{name}/promote" in openapi["paths"]
    before = table_counts(owner)
    response = httpx.put(f"{server.url}/api/v1/models/ci/digits/aliases/prod", json={"version": 1},
                         headers={"Authorization": f"Bearer {tokens['ann']}"})
    assert response.status_code == 403
    assert response.json()["error"] == "permission"
    assert "ann needs role 'releaser' on ci/digits to move protected alias 'prod' (has: reader)" in response.json()["detail"]
    assert table_counts(owner) == before


@pytest.mark.parametrize("header", [
    "Bearer \u00a0", "Bearer \u0085", "Bearer ", "Bearer  ", "Bearer \t", "Bearer \u2003", "Bearer",
    "bearer hfr_x", "Basic Zm9vOmJhcg==", "Bearer hfr_a hfr_b", "Bearer \u00a0hfr_x",
])
def test_a_malformed_or_whitespace_bearer_is_401_and_never_the_owner(served, header):
    import http.client

    owner, server, _tokens = served
    before = table_counts(owner)
    # on the wire as bytes: Latin-1 where it fits (how the server decodes a header), else UTF-8
    try:
        raw = header.encode("latin-1")
    except UnicodeEncodeError:
        raw = header.encode("utf-8")
    for method, path, body in [("GET", "/api/v1/whoami", None), ("GET", "/api/v1/info", None),
                               ("POST", "/api/v1/principals", {"name": "mallory"}),
                               ("POST", "/api/v1/grants", {"principal": "ann", "role": "admin", "scope": "*"}),
                               ("PUT", "/api/v1/models/ci/digits/aliases/prod", {"version": 1})]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        payload = json.dumps(body).encode() if body is not None else b""
        conn.putrequest(method, path)
        conn.putheader("Authorization", raw)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(payload)))
        conn.endheaders(payload)
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        assert response.status == 401, (header, path, text)
        assert json.loads(text)["error"] == "auth"
        assert "owner" not in text
    assert table_counts(owner) == before
    assert owner.whoami()["owner"] is True  # the local registry object itself is unchanged


def test_for_token_refuses_an_empty_token_instead_of_acting_as_the_owner(served):
    owner, _server, _tokens = served
    from hybridfleet.errors import AuthError

    for token in ("", None):
        with pytest.raises(AuthError, match="missing token"):
            owner.for_token(token)


def test_remote_client_does_what_the_local_registry_does(served, tmp_path):
    owner, server, tokens = served
    save_model(tmp_path / "run", test_accuracy=0.97)
    ci = RemoteRegistry(server.url, tokens["ci"])
    v = ci.register("ci/digits", str(tmp_path / "run"), tags={"commit": "abc"})
    assert v.version == 1 and v.copied_bytes > 0
    ci.promote("ci/digits", 1, "prod", ["test_accuracy>=0.95"], "prod", 0.005)
    ci.register("ci/digits", str(tmp_path / "run"))
    ci.rollout("ci/digits", "prod", canary=2, weight=30)
    for key in ("a", "b", "c", "d"):
        assert ci.resolve("ci/digits@prod", key) == owner.resolve("ci/digits@prod", key)
    assert [e["action"] for e in ci.history("ci/digits")] == ["move", "canary"]
    assert [x.version for x in ci.search({"commit": "abc"})] == [1]
    pulled = ci.pull("ci/digits@1", "torch", "safetensors", str(tmp_path / "out"))
    assert Path(pulled["path"]).stat().st_size > 0
    with pytest.raises(GateFailedError) as refused:
        ci.promote("ci/digits", 2, "prod", ["test_accuracy>=0.99"])
    assert refused.value.reasons[0]["metric"] == "test_accuracy" and not refused.value.reasons[0]["passed"]
    with pytest.raises(PermissionDeniedError, match="needs role 'admin'"):
        ci.grant("ci", "admin", "ci")


def test_cli_exit_codes_come_from_the_errors_table(served, tmp_path):
    owner, server, tokens = served
    save_model(tmp_path / "run", test_accuracy=0.93)
    owner.register("ci/digits", str(tmp_path / "run"))
    as_ann = ["--registry", server.url, "--token", tokens["ann"]]
    as_ci = ["--registry", server.url, "--token", tokens["ci"]]
    code, _ = cli("registry", "alias", "ci/digits", "prod", "1", *as_ann)
    assert code == EXIT_CODES["permission"].code
    code, out = cli("registry", "promote", "ci/digits", "1", "--alias", "prod", "--require", "test_accuracy>=0.95", "--json", *as_ci)
    assert code == EXIT_CODES["gate"].code
    result = json.loads(out)
    assert result["passed"] is False and result["checks"][0]["value"] == 0.93
    code, _ = cli("registry", "promote", "ci/digits", "1", "--alias", "prod", "--require", "test_accuracy=>0.95", *as_ci)
    assert code == EXIT_CODES["registry"].code
    code, _ = cli("registry", "show", "ci/nope@1", *as_ci)
    assert code == EXIT_CODES["registry_not_found"].code
    code, out = cli("registry", "resolve", "ci/digits@1", *as_ann)
    assert code == 0 and json.loads(out)["version"] == 1
    assert owner.history("ci/digits") == []


def _ci_commands() -> dict[str, list[str]]:
    """Each job's commands in the GitHub workflow (image, train, release, rollback); the GitLab file must run the same."""
    gh = yaml.safe_load((REPO / "examples/ci/github-actions.yml").read_text())
    gl = yaml.safe_load((REPO / "examples/ci/gitlab-ci.yml").read_text())

    def lines(steps):
        return [line.strip() for s in steps if "run" in s for line in s["run"].splitlines() if line.strip()]

    jobs = {job: lines(gh["jobs"][job]["steps"]) for job in ("image", "train", "release", "rollback")}
    assert [c for c in jobs["image"] if c.startswith("hfleet") or c.startswith("docker")] == gl["image"]["script"]
    for job in ("train", "release", "rollback"):
        assert jobs[job] == gl[job]["script"], job
    return jobs


def _serving_objects(path: Path) -> list[dict]:
    """The objects `hfleet k8s render-serving -o PATH` wrote, each validated (KServe CRD, Kubernetes schemas)."""
    import kubernetes_validate

    from tests.kserve_schemas import validate

    objects = list(yaml.safe_load_all(path.read_text()))
    for obj in objects:
        if obj["kind"] == "InferenceService":
            validate(obj)
        else:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "InferenceService"]  # the keys stay in the cluster's Secret
    return objects


@pytest.mark.slow
def test_ci_example_commands_train_gate_export_canary_promote_and_rollback(tmp_path, seaweed, monkeypatch):
    """Runs the CI files' commands as written, except `docker build/push` and `pip install`:
    no Docker engine here, and the package is installed already. The jobs' container is this
    machine's environment; the registry store is a real S3 endpoint (SeaweedFS), as
    render-serving needs an object store KServe's storage initializer reads."""
    from hybridfleet.serve.export import export_version
    from tests.serve_models import DIGITS_FACTORY, trained_digits

    # Prepare: a registry server on S3 with the CI service account; prod -> v1 (exported), set once by hand
    s3 = {"AWS_ENDPOINT_URL": seaweed.endpoint_url, "AWS_ACCESS_KEY_ID": seaweed.key, "AWS_SECRET_ACCESS_KEY": seaweed.secret}
    for k, v in s3.items():
        monkeypatch.setenv(k, v)
    owner = Registry(f"sqlite:///{tmp_path / 'reg.db'}", store=seaweed.url(f"ci-{tmp_path.name}"))
    owner.register("ci/digits", trained_digits(tmp_path / "seed", "torch"))
    export_version(owner, "ci/digits@1", "onnx", tmp_path / "seed-onnx", f"{DIGITS_FACTORY}:build_torch")
    owner.move_alias("ci/digits", "prod", 1)
    token = owner.add_principal("ci-bot", "service")
    owner.grant("ci-bot", "writer", "ci")
    owner.grant("ci-bot", "releaser", "ci/digits")
    jobs = _ci_commands()
    hfleet = [sys.executable, "-m", "hybridfleet"]
    env = {**os.environ, **s3, "HFLEET_REGISTRY_TOKEN": token, "PYTHONPATH": str(REPO / "src")}
    checkout = tmp_path / "checkout"  # the release jobs' checkout: the repository's examples, its own scratch files
    checkout.mkdir()
    (checkout / "examples").symlink_to(REPO / "examples")

    def run_job(job: str, cwd: Path) -> list[str]:
        outputs = []
        for command in jobs[job]:
            argv = shlex.split(command)
            if argv[0] != "hfleet":
                assert command == "mkdir -p serving", command  # the only other command the jobs run
                (cwd / "serving").mkdir(exist_ok=True)
                continue
            argv += ["--run-root", str(tmp_path / "runs")] if argv[1] == "run" else []
            done = subprocess.run(hfleet + argv[1:], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, command + "\n" + done.stdout[-2000:] + done.stderr[-3000:]
            outputs.append(done.stdout)
        return outputs

    with Server(owner) as server:
        env["HFLEET_REGISTRY"] = server.url
        # Execute: the image job's render step (in a scratch dir: it writes ./Dockerfile)
        (tmp_path / "examples/ci").mkdir(parents=True)
        (tmp_path / "examples/ci/digits-ci.yaml").write_text((REPO / "examples/ci/digits-ci.yaml").read_text())
        render = [c for c in jobs["image"] if c.startswith("hfleet image render")]
        assert render
        for command in render:
            done = subprocess.run(hfleet + shlex.split(command)[1:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
        assert "FROM " in (tmp_path / "Dockerfile").read_text()
        train = run_job("train", REPO)  # from the repository root (what `actions/checkout` gives)
        release = run_job("release", checkout)
        # a release that failed after its canary started: the rollback job's commands
        owner.rollout("ci/digits", "prod", canary=1, weight=10)
        run_job("rollback", checkout)
    # Assert: the train job registered v2 and the gate passed it
    assert "registered ci/digits v2 as candidate" in train[0]
    assert "model: file://" in train[0] and "lineage in MODEL.json" in train[0]
    gated = json.loads(train[1])
    assert gated["passed"] and gated["alias_state"]["version"] == 2
    lineage = owner.get_version("ci/digits@gated").lineage
    assert lineage["job"] == "digits-ci" and lineage["git"]["commit"] and lineage["model"]["which"] == "final"
    # the export was verified and stored in the registry's S3 store
    assert "onnx artefact verified on" in release[0] and "stored at s3://" in release[0]
    uri = {v: owner.get_version(f"ci/digits@{v}").tags["export.onnx.uri"] for v in (1, 2)}
    assert uri[2].startswith(owner.store_url + "/exports/ci/digits/v2/")
    # one InferenceService per step, each valid, following the rollout
    serving = checkout / "serving"
    predictor = {step: _serving_objects(serving / f"{step}.yaml")[1]["spec"]["predictor"]
                 for step in ("0-stable", "1-canary", "2-promoted", "3-rolled-back")}  # fmt: skip
    assert predictor["0-stable"]["model"]["storageUri"] == uri[1] and "canaryTrafficPercent" not in predictor["0-stable"]
    assert predictor["1-canary"]["canaryTrafficPercent"] == 10 and predictor["1-canary"]["model"]["storageUri"] == uri[2]
    assert "canaryTrafficPercent" not in predictor["2-promoted"] and predictor["2-promoted"]["model"]["storageUri"] == uri[2]
    assert predictor["3-rolled-back"]["canaryTrafficPercent"] == 0
    assert all(p["serviceAccountName"] == predictor["0-stable"]["serviceAccountName"] for p in predictor.values())
    # the registry's record: who moved what
    events = [(e["alias"], e["action"], e["actor"], e["to_version"]) for e in owner.history("ci/digits")]
    assert [e for e in events if e[2] == "ci-bot"] == [
        ("candidate", "move", "ci-bot", 2), ("gated", "move", "ci-bot", 2), ("prod", "canary", "ci-bot", 1),
        ("prod", "promote", "ci-bot", 2), ("prod", "rollback", "ci-bot", 2)]  # fmt: skip
    assert owner.resolve("ci/digits@prod")["version"] == 2


def test_a_server_reads_local_checkpoints_only_under_its_allowed_folders(db_url, tmp_path):
    owner = Registry(db_url, store=str(tmp_path / "artifacts"))
    token = owner.add_principal("ci", "service")
    owner.grant("ci", "writer", "ci")
    save_model(tmp_path / "allowed" / "run")
    save_model(tmp_path / "elsewhere" / "run")
    from hybridfleet.store import open_store

    roots = [owner.store_url, open_store(str(tmp_path / "allowed")).url]
    server = Server(owner)
    server.server.config.app = create_app(owner, roots)
    with server:
        ci = RemoteRegistry(server.url, token)
        assert ci.register("ci/m", str(tmp_path / "allowed" / "run")).version == 1
        before = table_counts(owner)
        with pytest.raises(RegistryError, match="reads local checkpoints only under"):
            ci.register("ci/m", str(tmp_path / "elsewhere" / "run"))
        assert table_counts(owner) == before


def test_cli_refuses_an_older_schema_with_exit_19_then_migrates_it(db_url, tmp_path):
    from hybridfleet.registry import db

    engine = db.make_engine(db_url)
    db.upgrade(engine, "0001")
    code, _ = cli("registry", "ls", "--registry", db_url)
    assert code == EXIT_CODES["schema"].code and db.current_revision(engine) == "0001"
    code, out = cli("registry", "migrate", "--db", db_url)
    assert code == 0 and f"0001 -> {db.head_revision()}" in out
    code, _ = cli("registry", "init", "--registry", db_url, "--store", str(tmp_path / "a"))
    assert code == 0 and db.current_revision(engine) == db.head_revision()


def test_cli_imports_a_hub_model_into_a_server_and_a_reader_is_refused(served, tmp_path):
    pytest.importorskip("huggingface_hub")
    from tests.test_registry_hub import COMMIT, hf_cache

    owner, server, tokens = served
    weights = {"linear.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "linear.bias": np.ones(3, np.float32)}
    cache = hf_cache(tmp_path / "hf", weights)
    before = table_counts(owner)
    code, _ = cli("registry", "import", "hf:org/tiny@main", "--as", "ci/tiny", "--cache-dir", str(cache), "--offline",
                  "--registry", server.url, "--token", tokens["ann"])
    assert code != 0 and table_counts(owner) == before  # a reader may not import
    code, out = cli("registry", "import", "hf:org/tiny@main", "--as", "ci/tiny", "--cache-dir", str(cache), "--offline",
                    "--registry", server.url, "--token", tokens["ci"])
    assert code == 0, out
    assert f"imported hf:org/tiny@main (revision {COMMIT}) as ci/tiny v1" in out
    info = owner.get_version("ci/tiny@1")
    assert info.lineage["hub"]["resolved_revision"] == COMMIT
    assert not (tmp_path / "artifacts" / "imports").exists() or not any((tmp_path / "artifacts" / "imports").iterdir())
    pulled = owner.pull("ci/tiny@1", "torch", "safetensors", str(tmp_path / "out"))
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(pulled["path"])["linear.weight"], weights["linear.weight"])


def test_registry_serve_prints_the_url_it_serves_once_bound(tmp_path):
    import re

    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "registry", "serve", "--db", str(tmp_path / "r.db"),
                             "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()  # the first line: where it serves
        match = re.match(r"hfleet registry serve: (http://127\.0\.0\.1:\d+)/api/v1 \(OpenAPI at \1/docs\)", line)
        assert match, line
        deadline = time.monotonic() + 60
        while True:
            try:
                answer = httpx.get(f"{match.group(1)}/api/v1/whoami", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the announced URL never answered"
                time.sleep(0.1)
        assert answer.status_code == 401 and answer.json()["error"] == "auth"
    finally:
        proc.terminate()
        proc.wait(30)


def test_rollout_canary_takes_an_alias_and_refuses_a_missing_one_changing_nothing(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'reg.db'}"
    reg = Registry(url, store=str(tmp_path / "artifacts"))
    for seed in (0, 1):
        reg.register("ci/m", save_model(tmp_path / f"run-{seed}", seed=seed))
    reg.move_alias("ci/m", "prod", 1)
    reg.move_alias("ci/m", "gated", 2)
    before = reg.history("ci/m")
    code, _ = cli("registry", "rollout", "ci/m", "--alias", "prod", "--canary", "nosuch", "--weight", "10", "--registry", url)
    assert code == EXIT_CODES["registry_not_found"].code and "has no alias 'nosuch'" in capsys.readouterr().err
    assert reg.history("ci/m") == before and reg.resolve("ci/m@prod")["version"] == 1
    code, out = cli("registry", "rollout", "ci/m", "--alias", "prod", "--canary", "gated", "--weight", "10", "--registry", url)
    assert code == 0 and json.loads(out)["canary_version"] == 2
    assert reg.history("ci/m")[-1]["canary_version"] == 2 and reg.history("ci/m")[-1]["canary_weight"] == 10
