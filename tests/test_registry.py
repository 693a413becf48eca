"""The model registry on SQLite and on a real PostgreSQL: versions, tags, aliases, history,
permissions, the promotion gate, gray release, pulls with conversion, and every refusal
leaving the database and the store as they were."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt import save_checkpoint
from hybridfleet.errors import (
    AuthError,
    CheckpointError,
    ConflictError,
    GateFailedError,
    PermissionDeniedError,
    RegistryError,
    RegistryNotFoundError,
)
from hybridfleet.registry import Registry
from hybridfleet.registry.aliases import BUCKETS, bucket
from tests.registry_helpers import files_under, save_model, table_counts

pytest_plugins = ["tests.registry_fixtures", "tests.seaweed"]
pytestmark = pytest.mark.torch  # the versions are torch checkpoints (tests/registry_helpers.save_model)


# ------------------------------------------------------------------ versions and artifacts
def test_register_copies_only_missing_blobs_and_records_manifest_sha256(registry, tmp_path):
    # Prepare
    ckpt = save_model(tmp_path / "run", test_accuracy=0.97)
    # Execute
    v1 = registry.register("vision/digits", ckpt, tags={"team": "cv", "data": "digits", "stage": "dev"}, description="first")
    v2 = registry.register("vision/digits", ckpt)
    # Assert
    assert (v1.version, v2.version) == (1, 2)
    assert v1.copied_bytes == v1.size_bytes > 0
    assert v2.copied_bytes == 0  # the same content is already in the store
    assert len(v1.manifest_sha256) == 64 and v1.framework == "torch" and v1.step == 10
    shown = registry.get_version("vision/digits@1")
    assert shown.metrics == {"test_accuracy": 0.97} and shown.tags["team"] == "cv" and shown.description == "first"
    assert registry.get_version("vision/digits").version == 2  # no alias, no version: the newest
    assert [v.version for v in registry.search({"team": "cv", "data": "digits", "stage": "dev"})] == [1]
    assert registry.list_models() == [{"name": "vision/digits", "description": "", "latest": 2}]


def test_registering_a_checkpoint_already_in_the_store_copies_no_tensor_bytes(registry):
    # Prepare: the run wrote its checkpoint straight into the registry's store
    info = save_checkpoint(registry.store_url, 5, tensors={"w": np.ones((256, 256), np.float32)})
    state_bytes = next(f.size_bytes for f in info.files if f.role == "state")
    # Execute
    version = registry.register("default/raw", registry.store_url)
    # Assert: only state.json (JSON, not tensors) becomes a blob
    assert version.copied_bytes == state_bytes and version.size_bytes - state_bytes > 256 * 256 * 4


def test_unknown_model_version_alias_and_checkpoint_are_clear_errors_and_change_nothing(registry, tmp_path):
    save_model(tmp_path / "run")
    registry.register("m", str(tmp_path / "run"))
    before, store_before = table_counts(registry), files_under(tmp_path / "artifacts")
    with pytest.raises(RegistryNotFoundError, match="no model default/nope"):
        registry.get_version("nope@prod")
    with pytest.raises(RegistryNotFoundError, match="has no version 9"):
        registry.get_version("m@9")
    with pytest.raises(RegistryNotFoundError, match="has no alias 'prod'"):
        registry.resolve("m@prod")
    with pytest.raises(RegistryNotFoundError, match="has no version 9"):
        registry.move_alias("m", "staging", 9)
    with pytest.raises(CheckpointError, match="no checkpoint with a manifest"):
        registry.register("m", str(tmp_path / "empty"))
    with pytest.raises(RegistryError, match="model name 'Bad Name'"):
        registry.register("Bad Name", str(tmp_path / "run"))
    assert table_counts(registry) == before and files_under(tmp_path / "artifacts") == store_before


# ------------------------------------------------------------------ pulls
@pytest.mark.parametrize("src,dst,fmt", [("torch", "paddle", "pdparams"), ("paddle", "torch", "pt"), ("torch", "torch", "safetensors")])
def test_pull_converts_between_frameworks(registry, tmp_path, src, dst, fmt):
    pytest.importorskip("paddle")
    # Prepare
    save_model(tmp_path / "run", framework=src, test_accuracy=0.9)
    registry.register("m", str(tmp_path / "run"))
    registry.move_alias("m", "staging", 1)
    # Execute
    out = registry.pull("m@staging", dst, fmt, str(tmp_path / "out"))
    # Assert: the file loads in the target framework with the source's values in its layout
    if dst == "paddle":
        import paddle

        loaded = {k: v.numpy() for k, v in paddle.load(out["path"]).items()}
        np.testing.assert_array_equal(loaded["0.weight"], _weights(tmp_path / "run")["0.weight"].T)
    elif fmt == "pt":
        import torch

        loaded = {k: v.numpy() for k, v in torch.load(out["path"]).items()}
        np.testing.assert_array_equal(loaded["0.weight"], _weights(tmp_path / "run")["0.weight"].T)
    else:
        from safetensors.numpy import load_file

        np.testing.assert_array_equal(load_file(out["path"])["2.bias"], _weights(tmp_path / "run")["2.bias"])
    assert out["version"] == 1


@pytest.mark.torch
def test_pull_without_a_framework_writes_the_versions_own(registry, tmp_path):
    save_model(tmp_path / "run", framework="torch", test_accuracy=0.9)
    registry.register("m", str(tmp_path / "run"))
    out = registry.pull("m@1", None, "safetensors", str(tmp_path / "out"))
    assert out["framework"] == "torch" and Path(out["path"]).stat().st_size > 0


def _weights(root):
    from hybridfleet.ckpt.checkpoint import read_newest_valid
    from hybridfleet.store import open_store

    return read_newest_valid(open_store(str(root)), None)[2]["model"]


def test_pull_of_a_corrupt_or_missing_artifact_is_refused_and_writes_nothing(registry, tmp_path):
    # Prepare
    save_model(tmp_path / "run")
    info = registry.register("m", str(tmp_path / "run"))
    store = tmp_path / "artifacts"
    manifest = __import__("json").loads((store / info.manifest_path).read_text())
    blob = store / next(f["path"] for f in manifest["files"] if f["role"] == "model")
    good = blob.read_bytes()
    # Execute + Assert: one flipped byte
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        registry.pull("m@1", "torch", "safetensors", str(tmp_path / "out"))
    # a missing blob
    blob.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        registry.pull("m@1", "torch", "safetensors", str(tmp_path / "out"))
    # a replaced manifest
    blob.write_bytes(good)
    (store / info.manifest_path).write_text((store / info.manifest_path).read_text().replace('"step": 10', '"step": 11'))
    with pytest.raises(CheckpointError, match="manifest sha256 differs"):
        registry.pull("m@1", "torch", "safetensors", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_pull_format_must_fit_the_framework(registry, tmp_path):
    save_model(tmp_path / "run")
    registry.register("m", str(tmp_path / "run"))
    with pytest.raises(RegistryError, match="--format pt is a torch file"):
        registry.pull("m@1", "paddle", "pt", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ aliases and history
def test_alias_moves_form_an_append_only_history_and_a_stale_revision_conflicts(registry, tmp_path):
    save_model(tmp_path / "run")
    for _ in range(3):
        registry.register("m", str(tmp_path / "run"))
    first = registry.move_alias("m", "staging", 1, reason="smoke tests passed")
    registry.move_alias("m", "staging", 2, expect_revision=first["revision"])
    before = table_counts(registry)
    with pytest.raises(ConflictError, match="at revision 2, not 1"):
        registry.move_alias("m", "staging", 3, expect_revision=first["revision"])
    assert table_counts(registry) == before
    events = registry.history("m", "staging")
    assert [(e["from_version"], e["to_version"]) for e in events] == [(None, 1), (1, 2)]
    assert events[0]["reason"] == "smoke tests passed" and events[0]["actor"] == "local-owner"
    assert registry.resolve("m@staging")["version"] == 2


def test_concurrent_alias_moves_one_wins_and_history_stays_a_chain(registry, tmp_path):
    save_model(tmp_path / "run")
    for _ in range(4):
        registry.register("m", str(tmp_path / "run"))
    start = registry.move_alias("m", "staging", 1)
    barrier = threading.Barrier(3)
    outcomes: list[str] = []

    def mover(version: int) -> None:
        barrier.wait()
        try:
            registry.move_alias("m", "staging", version, expect_revision=start["revision"])
            outcomes.append("ok")
        except ConflictError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=mover, args=(v,)) for v in (2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["conflict", "conflict", "ok"]
    events = registry.history("m", "staging")
    assert len(events) == 2 and events[1]["from_version"] == events[0]["to_version"] == 1
    assert registry.resolve("m@staging")["version"] == events[1]["to_version"]


# ------------------------------------------------------------------ permissions
def test_roles_are_enforced_and_refusals_name_the_missing_role(registry, tmp_path):
    # Prepare
    save_model(tmp_path / "run", test_accuracy=0.97)
    tokens = {n: registry.add_principal(n, "service" if n == "ci" else "user") for n in ("ann", "ci", "rel", "adm")}
    registry.grant("ann", "reader", "vision")
    registry.grant("ci", "writer", "vision")
    registry.grant("rel", "releaser", "vision/digits")
    registry.grant("adm", "admin", "vision")
    ann, ci, rel, adm = (registry.for_token(tokens[n]) for n in ("ann", "ci", "rel", "adm"))
    # Execute + Assert
    with pytest.raises(PermissionDeniedError, match="ann needs role 'writer' on vision/digits to register a version \\(has: reader\\)"):
        ann.register("vision/digits", str(tmp_path / "run"))
    v = ci.register("vision/digits", str(tmp_path / "run"))  # the creator ...
    with pytest.raises(PermissionDeniedError, match="ci needs role 'admin' on vision/digits"):
        ci.grant("ci", "admin", "vision/digits")  # ... gets no admin right
    ci.move_alias("vision/digits", "staging", v.version)  # unprotected: writers may
    before = table_counts(registry)
    with pytest.raises(PermissionDeniedError, match="needs role 'releaser' on vision/digits to move protected alias 'prod' \\(has: writer\\)"):
        ci.move_alias("vision/digits", "prod", v.version)
    with pytest.raises(PermissionDeniedError, match="needs role 'releaser'"):
        ci.promote("vision/digits", v.version, "prod", ["test_accuracy>=0.9"])
    with pytest.raises(RegistryNotFoundError, match=r"no model other/x in this registry \(or no permission to see it\)"):
        ann.get_version("other/x@1")  # no role there: the answer a missing model gets
    assert table_counts(registry) == before
    rel.promote("vision/digits", v.version, "prod", ["test_accuracy>=0.9"])
    adm.protect_alias("vision/digits", "staging")
    with pytest.raises(PermissionDeniedError, match="protected alias 'staging'"):
        ci.move_alias("vision/digits", "staging", v.version)
    assert ann.resolve("vision/digits@prod")["version"] == v.version
    assert [m["name"] for m in ann.list_models()] == ["vision/digits"]
    with pytest.raises(AuthError, match="not valid"):
        registry.for_token("hfr_forged")
    with pytest.raises(PermissionDeniedError, match="needs role 'admin' on namespace \\*"):
        adm.remove_principal("ci")  # admin of a namespace is not admin of the registry
    registry.remove_principal("ci")
    with pytest.raises(AuthError, match="not valid"):
        registry.for_token(tokens["ci"])


# ------------------------------------------------------------------ the promotion gate
def test_promotion_gate_passes_fails_and_checks_regression_with_tolerance(registry, tmp_path):
    for acc, step in ((0.96, 1), (0.958, 2), (0.94, 3)):
        save_model(tmp_path / f"run{step}", step=step, test_accuracy=acc)
        registry.register("m", str(tmp_path / f"run{step}"))
    first = registry.promote("m", 1, "prod", ["test_accuracy>=0.95"], "prod", 0.005)
    assert first["passed"] and first["alias_state"]["version"] == 1
    second = registry.promote("m", 2, "prod", ["test_accuracy>=0.95"], "prod", 0.005)  # 0.958 >= 0.96 - 0.005
    assert [c["check"] for c in second["checks"]] == ["require", "no_regression"]
    before = table_counts(registry)
    with pytest.raises(GateFailedError) as refused:
        registry.promote("m", 3, "prod", ["test_accuracy>=0.95"], "prod", 0.005)
    assert [c["passed"] for c in refused.value.reasons] == [False, False]
    assert "test_accuracy=0.94 fails test_accuracy>=0.95" in str(refused.value)
    with pytest.raises(GateFailedError, match="no metric 'val_f1'"):
        registry.promote("m", 2, "prod", ["val_f1>=0.5"])
    with pytest.raises(RegistryError, match="does not parse"):
        registry.promote("m", 2, "prod", ["test_accuracy>>0.5"])
    with pytest.raises(GateFailedError, match="regression"):
        registry.promote("m", 3, "prod", ["test_accuracy>=0.9"], "prod", 0.005)
    assert table_counts(registry) == before and registry.resolve("m@prod")["version"] == 2


# ------------------------------------------------------------------ gray release
def test_canary_weights_hold_within_one_point_over_100k_keys_and_keys_are_sticky():
    keys = [f"user-{i}" for i in range(100_000)]
    buckets = np.array([bucket("ns/m", "prod", k) for k in keys])
    for weight in (1, 10, 50, 90):
        share = float(np.mean(buckets < weight * BUCKETS // 100)) * 100
        assert abs(share - weight) <= 1.0, (weight, share)
    # a key on the canary at 10 % is still on it at 50 %
    assert set(np.nonzero(buckets < 1000)[0]) <= set(np.nonzero(buckets < 5000)[0])


def test_rollout_canary_promote_rollback_through_the_registry(registry, tmp_path):
    save_model(tmp_path / "run")
    for _ in range(3):
        registry.register("m", str(tmp_path / "run"))
    registry.move_alias("m", "prod", 1)
    registry.rollout("m", "prod", canary=2, weight=10)
    keys = [f"k{i}" for i in range(400)]
    at10 = {k for k in keys if registry.resolve("m@prod", key=k)["version"] == 2}
    expected = {k for k in keys if bucket("default/m", "prod", k) < 1000}
    assert at10 == expected and 20 <= len(at10) <= 60
    assert registry.resolve("m@prod", key=keys[0]) == registry.resolve("m@prod", key=keys[0])  # deterministic
    registry.rollout("m", "prod", weight=50)
    at50 = {k for k in keys if registry.resolve("m@prod", key=k)["version"] == 2}
    assert at10 <= at50  # sticky while the weight grows
    assert registry.resolve("m@prod")["version"] == 1  # no key: the stable version
    registry.rollout("m", "prod", promote=True)
    assert registry.resolve("m@prod", key=keys[0])["version"] == 2
    registry.rollout("m", "prod", canary=3, weight=20)
    registry.rollout("m", "prod", rollback=True)
    before = table_counts(registry)
    with pytest.raises(RegistryError, match="no canary to roll back"):
        registry.rollout("m", "prod", rollback=True)
    with pytest.raises(RegistryError, match="exactly one of"):
        registry.rollout("m", "prod", canary=3, weight=20, promote=True)
    with pytest.raises(RegistryError, match="percentage in 0..100"):
        registry.rollout("m", "prod", canary=3, weight=120)
    assert table_counts(registry) == before
    actions = [(e["action"], e["to_version"], e["canary_version"]) for e in registry.history("m", "prod")]
    assert actions == [("move", 1, None), ("canary", 1, 2), ("canary", 1, 2), ("promote", 2, None),
                       ("canary", 2, 3), ("rollback", 2, None)]


# ------------------------------------------------------------------ schema
def test_an_older_schema_is_refused_with_the_migrate_command_then_migrated(db_url, tmp_path):
    from hybridfleet.errors import SchemaError
    from hybridfleet.registry import db

    engine = db.make_engine(db_url)
    db.upgrade(engine, "0001")
    from sqlalchemy import inspect

    tables_before = sorted(inspect(engine).get_table_names())
    with pytest.raises(SchemaError, match="hfleet registry migrate --db"):
        Registry(db_url, store=str(tmp_path / "a"))
    assert db.current_revision(engine) == "0001" and sorted(inspect(engine).get_table_names()) == tables_before
    db.upgrade(engine)
    assert Registry(db_url, store=str(tmp_path / "a")).list_models() == []


# ------------------------------------------------------------------ artifacts on real S3 (SeaweedFS)
def test_s3_artifact_store_registers_pulls_and_detects_corruption(db_url, seaweed, s3_url, tmp_path, monkeypatch):
    # Prepare: S3 endpoint and credentials by environment, as in a deployment
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret)
    reg = Registry(db_url, store=s3_url)
    save_model(tmp_path / "run", test_accuracy=0.9)
    # Execute
    first = reg.register("m", str(tmp_path / "run"))
    in_store = save_checkpoint(s3_url, 3, tensors={"w": np.ones((128, 128), np.float32)})
    second = reg.register("raw", s3_url)
    out = reg.pull("m@1", "torch", "safetensors", str(tmp_path / "out"))
    # Assert
    assert first.copied_bytes == first.size_bytes
    assert second.copied_bytes == next(f.size_bytes for f in in_store.files if f.role == "state")
    assert Path(out["path"]).stat().st_size > 0
    from hybridfleet.store import open_store

    store = open_store(s3_url)
    manifest = __import__("json").loads(store.get_bytes(first.manifest_path))
    blob = next(f["path"] for f in manifest["files"] if f["role"] == "model")
    data = bytearray(store.get_bytes(blob))
    data[-1] ^= 1
    store.put_bytes(blob, bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        reg.pull("m@1", "torch", "safetensors", str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()


def test_registering_a_corrupt_checkpoint_writes_no_row_and_no_manifest(registry, tmp_path):
    # Prepare: a checkpoint whose model file has one flipped byte
    save_model(tmp_path / "run")
    manifest = next((tmp_path / "run").glob("step-*/MANIFEST.json"))
    entry = next(f for f in __import__("json").loads(manifest.read_text())["files"] if f["role"] == "model")
    blob = tmp_path / "run" / entry["path"]
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    before = table_counts(registry)
    # Execute
    with pytest.raises(CheckpointError, match=r"crc32 mismatch \(corrupt file\); nothing was written"):
        registry.register("fresh/model", str(tmp_path / "run"))
    # Assert: no model, no version, no manifest in the store
    assert table_counts(registry) == before
    assert not any(p.name.startswith("MANIFEST") for p in (tmp_path / "artifacts").rglob("*"))


def test_concurrent_registrations_get_distinct_versions_each_with_its_manifest(registry, tmp_path):
    save_model(tmp_path / "run")
    barrier = threading.Barrier(4)
    numbers: list[int] = []

    def register() -> None:
        barrier.wait()
        numbers.append(registry.register("m", str(tmp_path / "run")).version)

    threads = [threading.Thread(target=register) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(numbers) == [1, 2, 3, 4]
    for n in numbers:
        assert registry.pull(f"m@{n}", "torch", "safetensors", str(tmp_path / f"out{n}"))["version"] == n


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_registering_the_latest_versions_tensors_again_is_noted(registry, tmp_path, framework):
    # Prepare: v1 from a checkpoint, a second checkpoint of other weights
    same = save_model(tmp_path / "run", framework=framework)
    other = save_model(tmp_path / "other", framework=framework, seed=1)
    first = registry.register("dup/model", same)
    # Execute
    again = registry.register("dup/model", same)
    changed = registry.register("dup/model", other)
    # Assert: the repeat says which version it repeats (and copied nothing); new weights do not
    assert first.duplicate_of is None
    assert (again.version, again.duplicate_of, again.copied_bytes) == (2, 1, 0)
    assert changed.duplicate_of is None


@pytest.mark.torch  # save_model builds a torch MLP
def test_publish_of_the_same_checkpoint_twice_prints_a_note(tmp_path, capsys):
    from hybridfleet.cli.app import main

    ckpt = save_model(tmp_path / "run")
    db = f"sqlite:///{tmp_path / 'reg.db'}"
    main(["registry", "publish", "n/m", ckpt, "--step", "10", "-r", db])
    first = capsys.readouterr()
    main(["registry", "publish", "n/m", ckpt, "--step", "10", "-r", db])
    second = capsys.readouterr()
    assert "note:" not in first.err
    assert "registered n/m v2" in second.out
    assert "note: v2 has exactly the tensors of v1" in second.err


@pytest.mark.torch  # save_model builds a torch MLP
@pytest.mark.paddle
def test_pull_into_paddle_prints_no_framework_noise(tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    ckpt = save_model(tmp_path / "run")
    db = f"sqlite:///{tmp_path / 'reg.db'}"
    # a PATH without ccache, so Paddle would print its 'No ccache found' warning if nothing stopped it
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if not shutil.which("ccache", path=d))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), HFLEET_REGISTRY_TOKEN="",
               PATH=path)
    hfleet = [sys.executable, "-m", "hybridfleet"]
    subprocess.run([*hfleet, "registry", "publish", "n/m", ckpt, "--step", "10", "-r", db], env=env, check=True,
                   capture_output=True, timeout=120)
    # Execute: the pull converts into Paddle's format, so it imports paddle
    proc = subprocess.run([*hfleet, "registry", "pull", "n/m@1", "--framework", "paddle", "--format", "pdparams",
                           "-o", str(tmp_path / "out"), "-r", db], env=env, capture_output=True, text=True, timeout=120)
    # Assert: one line of ours, nothing from the framework
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.pdparams").is_file()
    assert proc.stdout.strip().startswith("n/m v1 -> ")
    assert "ccache" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
