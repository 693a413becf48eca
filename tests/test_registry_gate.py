"""The promotion gate judges evidence: the checkpoint's own metrics or a figure it measures itself
(`promote --evaluate`), never a writer's claim unless told to; non-finite metrics never enter.
Every refusal names its reason and leaves rows, aliases and metrics as they were."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.errors import GateFailedError, RegistryError
from hybridfleet.registry import Registry
from hybridfleet.registry.evaluate import measure
from tests.registry_helpers import files_under, save_model, table_counts

pytest_plugins = ["tests.registry_fixtures"]
REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)]

# An evaluation script as a user writes one: the real framework model, the pulled weights, one JSON line.
EVAL_SCRIPT = '''
import json, os, sys
import numpy as np
from safetensors.numpy import load_file

rng = np.random.default_rng(7)
x = rng.standard_normal((512, 8)).astype(np.float32)
y = rng.integers(0, 4, 512)
weights = load_file(sys.argv[1])
if os.environ["HFLEET_EVAL_FRAMEWORK"] == "torch":
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    pred = model(torch.from_numpy(x)).argmax(1).numpy()
else:
    import paddle
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
    pred = model(paddle.to_tensor(x)).argmax(1).numpy()
print("evaluating", file=sys.stderr)
print(json.dumps({"test_accuracy": float((pred == y).mean())}))
'''


def expected_accuracy(framework: str, seed: int = 0) -> float:
    """The accuracy the script must find, computed here on the model `save_model` builds with ``seed``."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((512, 8)).astype(np.float32)
    y = rng.integers(0, 4, 512)
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        pred = model(torch.from_numpy(x)).argmax(1).numpy()
    else:
        import paddle

        paddle.seed(seed)
        model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
        pred = model(paddle.to_tensor(x)).argmax(1).numpy()
    return float((pred == y).mean())


def script(tmp_path: Path, text: str = EVAL_SCRIPT, name: str = "evaluate.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def sqlite_registry(tmp_path) -> Registry:
    return Registry(f"sqlite:///{tmp_path / 'registry.db'}", store=str(tmp_path / "artifacts"))


# ------------------------------------------------------------------ claims
@pytest.mark.torch
def test_a_claimed_metric_is_stored_as_claimed_and_the_gate_refuses_it_unless_trusted(registry, tmp_path):
    # Prepare: the checkpoint records only its loss; the writer claims an accuracy
    ckpt = save_model(tmp_path / "run", val_loss=0.4)
    info = registry.register("m", ckpt, metrics={"test_accuracy": 0.999})
    before = table_counts(registry)
    # Execute
    with pytest.raises(GateFailedError) as refused:
        registry.promote("m", 1, "prod", ["test_accuracy>=0.95"])
    # Assert
    assert info.metric_sources["test_accuracy"] == {"source": "claimed", "by": "local-owner"}
    assert info.metric_sources["val_loss"] == {"source": "checkpoint", "origin": "manifest"}
    assert "test_accuracy=0.999 is claimed, not evidence" in str(refused.value)
    assert "--evaluate SCRIPT" in str(refused.value) and "--trust-claimed" in str(refused.value)
    assert table_counts(registry) == before
    with pytest.raises(RegistryError, match="no alias 'prod'"):
        registry.resolve("m@prod")
    trusted = registry.promote("m", 1, "prod", ["test_accuracy>=0.95"], trust_claimed=True)
    assert trusted["passed"] and registry.resolve("m@prod")["version"] == 1
    assert "(claimed)" in trusted["checks"][0]["reason"]


@pytest.mark.torch
def test_a_claim_contradicting_the_checkpoint_is_refused_at_registration_and_changes_nothing(registry, tmp_path):
    # Prepare: the checkpoint says 0.50 (the case: the writer sent 0.999)
    ckpt = save_model(tmp_path / "run", test_accuracy=0.5)
    registry.register("m", ckpt)
    before, blobs = table_counts(registry), files_under(tmp_path / "artifacts")
    # Execute
    with pytest.raises(RegistryError) as refused:
        registry.register("m", ckpt, metrics={"test_accuracy": 0.999})
    # Assert
    assert "metric 'test_accuracy': the checkpoint records 0.5; a claim of 0.999 cannot replace it" in str(refused.value)
    assert table_counts(registry) == before and files_under(tmp_path / "artifacts") == blobs
    with pytest.raises(GateFailedError, match="test_accuracy=0.5 fails test_accuracy>=0.95"):
        registry.promote("m", 1, "prod", ["test_accuracy>=0.95"])


@pytest.mark.torch
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_metrics_are_refused_at_registration_and_change_nothing(registry, tmp_path, bad):
    # Prepare
    ckpt = save_model(tmp_path / "run", val_loss=0.4)
    before, blobs = table_counts(registry), files_under(tmp_path / "artifacts")
    # Execute
    with pytest.raises(RegistryError) as refused:
        registry.register("m", ckpt, metrics={"test_accuracy": bad})
    # Assert
    assert f"metric 'test_accuracy' is {bad!r}; metrics must be finite numbers" in str(refused.value)
    assert "nothing registered" in str(refused.value)
    assert table_counts(registry) == before and files_under(tmp_path / "artifacts") == blobs


@pytest.mark.torch
def test_a_checkpoint_recording_a_non_finite_metric_is_refused(sqlite_registry, tmp_path):
    from hybridfleet.ckpt import save_checkpoint

    save_checkpoint(f"file://{tmp_path / 'ckpt'}", 3, tensors={"w": np.ones(4, np.float32)}, metrics={"loss": float("nan")})
    before = table_counts(sqlite_registry)
    with pytest.raises(RegistryError, match="metric 'loss' is nan; metrics must be finite numbers"):
        sqlite_registry.register("m", f"file://{tmp_path / 'ckpt'}")
    assert table_counts(sqlite_registry) == before


# ------------------------------------------------------------------ measuring
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_evaluate_measures_the_stored_weights_and_records_the_figure_with_its_provenance(sqlite_registry, tmp_path, framework):
    # Prepare: a claim of 0.999 the weights do not support
    ckpt = save_model(tmp_path / "run", framework=framework, val_loss=0.4)
    info = sqlite_registry.register("m", ckpt, metrics={"test_accuracy": 0.999})
    path = script(tmp_path)
    # Execute
    measurement = measure(sqlite_registry, "m@1", path)
    with pytest.raises(GateFailedError) as refused:
        sqlite_registry.promote("m", 1, "prod", ["test_accuracy>=0.95"], measurement=measurement)
    # Assert: the figure is the real model's accuracy on the script's data, recorded as measured
    expected = expected_accuracy(framework)
    assert measurement.metrics == {"test_accuracy": expected} and expected < 0.95
    assert f"test_accuracy={expected:g} fails test_accuracy>=0.95 (measured)" in str(refused.value)
    shown = sqlite_registry.get_version("m@1")
    record = shown.metric_sources["test_accuracy"]
    assert shown.metrics["test_accuracy"] == expected
    assert record["source"] == "measured" and record["by"] == "local-owner" and record["script"] == "evaluate.py"
    assert record["script_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert record["manifest_sha256"] == info.manifest_sha256 and record["at_s"] > 0
    assert record["replaced"] == {"value": 0.999, "source": "claimed"}
    with pytest.raises(RegistryError, match="no alias 'prod'"):
        sqlite_registry.resolve("m@prod")
    passed = sqlite_registry.promote("m", 1, "staging", [f"test_accuracy>={expected}"])
    assert passed["passed"] and passed["checked"]


@pytest.mark.torch
@pytest.mark.parametrize("text,message", [
    ("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n", "exited 3; nothing recorded; its stderr: boom"),
    ("print('accuracy is high')\n", "must print one JSON object of metrics on stdout"),
    ("print('[0.9]')\n", "must print one JSON object of metrics on stdout"),
    ("print('{\"test_accuracy\": NaN}')\n", "metric 'test_accuracy' is nan"),
    ("print('{\"test_accuracy\": \"high\"}')\n", "metric 'test_accuracy' must be a number"),
])
def test_a_failing_or_malformed_evaluation_is_refused_and_records_nothing(sqlite_registry, tmp_path, text, message):
    # Prepare
    sqlite_registry.register("m", save_model(tmp_path / "run", val_loss=0.4))
    before, version = table_counts(sqlite_registry), sqlite_registry.get_version("m@1")
    # Execute
    with pytest.raises(RegistryError) as refused:
        measure(sqlite_registry, "m@1", script(tmp_path, text))
    # Assert
    assert message in str(refused.value)
    assert table_counts(sqlite_registry) == before and sqlite_registry.get_version("m@1") == version


@pytest.mark.torch
def test_a_measurement_of_other_weights_is_refused(sqlite_registry, tmp_path):
    sqlite_registry.register("m", save_model(tmp_path / "a", seed=0))
    sqlite_registry.register("m", save_model(tmp_path / "b", seed=1))
    measured = measure(sqlite_registry, "m@1", script(tmp_path))
    before = sqlite_registry.get_version("m@2")
    with pytest.raises(RegistryError, match="the measurement was made on manifest .* not on default/m v2"):
        sqlite_registry.promote("m", 2, "prod", ["test_accuracy>=0"], measurement=measured)
    assert sqlite_registry.get_version("m@2") == before


# ------------------------------------------------------------------ the CLI
def hfleet(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    return subprocess.run([sys.executable, "-m", "hybridfleet", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=180)  # fmt: skip


@pytest.mark.torch
def test_cli_publish_metric_is_claimed_and_promote_says_what_it_checked(tmp_path):
    # Prepare
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    ckpt = save_model(tmp_path / "run", step=10, val_loss=0.4)
    published = hfleet("registry", "publish", "m", ckpt, "--step", "10", "--metric", "test_accuracy=0.999", "-r", db,
                       cwd=tmp_path)  # fmt: skip
    # Execute
    refused = hfleet("registry", "promote", "m", "1", "--alias", "prod", "--require", "test_accuracy>=0.95", "-r", db,
                     cwd=tmp_path)  # fmt: skip
    unchecked = hfleet("registry", "promote", "m", "1", "--alias", "staging", "-r", db, cwd=tmp_path)
    evaluated = hfleet("registry", "promote", "m", "1", "--alias", "prod", "--require", "test_accuracy>=0.2",
                       "--evaluate", str(script(tmp_path)), "-r", db, cwd=tmp_path)  # fmt: skip
    shown = json.loads(hfleet("registry", "show", "m@1", "-r", db, cwd=tmp_path).stdout)
    # Assert
    assert published.returncode == 0, published.stderr
    assert refused.returncode == 25 and "is claimed, not evidence" in refused.stderr
    assert unchecked.returncode == 0 and "no requirement given: nothing was checked" in unchecked.stdout
    assert "gate passed" not in unchecked.stdout
    expected = expected_accuracy("torch")
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"measured default/m v1 with {script(tmp_path)}: test_accuracy={expected:g}" in evaluated.stdout
    assert "(gate passed)" in evaluated.stdout
    assert shown["metric_sources"]["test_accuracy"]["source"] == "measured"
    assert shown["metrics"]["test_accuracy"] == expected


@pytest.mark.torch
def test_over_rest_claims_are_refused_and_a_measurement_is_recorded_as_the_callers(db_url, tmp_path):
    from tests.test_registry_server import Server

    owner = Registry(db_url, store=str(tmp_path / "artifacts"))
    token = owner.add_principal("ci", "service")
    owner.grant("ci", "releaser", "ci")
    ckpt = save_model(tmp_path / "artifacts" / "runs" / "r1", val_loss=0.4)
    with Server(owner) as server:
        from hybridfleet.registry.client import RemoteRegistry

        remote = RemoteRegistry(server.url, token)
        import httpx

        infinite = httpx.post(f"{server.url}/api/v1/models/ci/m/versions", headers={"Authorization": f"Bearer {token}",
                                                                                  "Content-Type": "application/json"},
                              content='{"checkpoint_url": "%s", "metrics": {"test_accuracy": Infinity}}' % ckpt)  # fmt: skip
        assert infinite.status_code == 422 and "finite" in infinite.json()["detail"], infinite.json()
        assert table_counts(owner)["versions"] == 0
        remote.register("ci/m", ckpt, metrics={"test_accuracy": 0.999})
        with pytest.raises(GateFailedError, match="is claimed, not evidence"):
            remote.promote("ci/m", 1, "prod", ["test_accuracy>=0.95"])
        result = remote.promote("ci/m", 1, "prod", ["test_accuracy>=0.2"], measurement=measure(remote, "ci/m@1", script(tmp_path)))
    assert result["passed"] and result["measured"]["metrics"] == {"test_accuracy": expected_accuracy("torch")}
    assert owner.get_version("ci/m@1").metric_sources["test_accuracy"]["by"] == "ci"


def test_versions_from_before_metric_sources_migrate_and_count_as_claimed(db_url, tmp_path):
    # Prepare: a database at the previous schema holding one version with a metric
    from sqlalchemy import text

    from hybridfleet.registry import db

    engine = db.make_engine(db_url)
    db.upgrade(engine, "0002")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO models (namespace, name, description, created_by, created_s) "
                          "VALUES ('default', 'old', '', 'someone', 1.0)"))
        conn.execute(text("INSERT INTO versions (model_id, version, manifest_path, manifest_sha256, size_bytes, metrics, "
                          "lineage, description, created_by, created_s) VALUES (1, 1, 'm', :sha, 1, :metrics, '{}', '', "
                          "'someone', 1.0)"), {"sha": "0" * 64, "metrics": '{"test_accuracy": 0.99}'})  # fmt: skip
    # Execute
    db.upgrade(engine)
    registry = Registry(db_url, store=str(tmp_path / "artifacts"))
    # Assert
    assert db.current_revision(engine) == db.head_revision()
    assert registry.get_version("old@1").metric_sources == {}
    with pytest.raises(GateFailedError, match="test_accuracy=0.99 is claimed, not evidence"):
        registry.promote("old", 1, "prod", ["test_accuracy>=0.95"])
