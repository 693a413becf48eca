"""Every run ends in a model: PS runs save periodic, best and final checkpoints of the framework
model from worker rank 0's pulled parameters, and MODEL.json records lineage.

Real `hfleet run` jobs (shards + workers as subprocesses, TLS and tokens on) with torch and paddle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.ckpt import list_checkpoints, load_checkpoint
from hybridfleet.ckpt.reader import list_steps
from hybridfleet.ckpt.run_model import (
    CARD_NAME,
    ModelCheckpointer,
    parse_keep_best,
    read_model_card,
    write_model_card,
)
from hybridfleet.errors import CheckpointError, SpecError
from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from hybridfleet.store import open_store

REPO = Path(__file__).resolve().parents[1]


def small_job(tmp_path: Path, example: str, **sections) -> Path:
    """The digits example cut to 150 BSP steps, one worker per site, no baselines."""
    data = yaml.safe_load((REPO / "examples" / example).read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["sites"] = {"hospital": {"workers": 1, "data": "digits:site-a"}, "cloud": {"workers": 1, "data": "digits:site-b"}}
    data["train"] = {"steps": 150, "batch_size": 32, "seed": 0, "eval_every_steps": 50, "site_baselines": False}
    data.pop("registry", None)
    data.update(sections)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("example", ["digits-hybrid.yaml", "digits-hybrid-paddle.yaml"])
def test_ps_run_ends_in_final_and_best_model_with_lineage(tmp_path, example):
    # Prepare
    job = small_job(tmp_path, example, checkpoint={"every_steps": 50, "keep_last": 2, "keep_best": "test_accuracy"},
                    registry={"publish_as": "test/digits", "require": ["test_accuracy>=0.5"], "alias": "staging",
                              "model": "best", "url": f"sqlite:///{tmp_path / 'reg.db'}"})
    spec = load_spec(job)
    # Execute
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs")
    # Assert
    assert summary["status"] == "completed", summary
    run_dir = Path(summary["run_dir"])
    model = summary["model"]
    assert model["url"] == f"file://{(run_dir / 'model').resolve()}"
    card = read_model_card(model["url"])
    assert card["final"]["step"] == model["final_step"] == 150
    # every_steps: 50 with keep_last: 2 leaves steps 100 and 150, plus the best by test_accuracy
    steps = list_steps(open_store(model["url"]))
    assert {100, 150} <= set(steps)
    assert card["best"]["metric"] == "test_accuracy" and card["best"]["step"] in steps
    best_value = max(i.metrics["test_accuracy"] for i in list_checkpoints(model["url"]) if "test_accuracy" in i.metrics)
    assert card["best"]["value"] == best_value
    lineage = card["lineage"]
    assert lineage["job"] == spec.name and lineage["run_id"] == run_dir.name
    assert lineage["framework"] == spec.framework and lineage["framework_version"]
    assert lineage["git"]["commit"] and isinstance(lineage["git"]["dirty"], bool)
    assert len(lineage["env_lock_hash"]) == 64
    assert lineage["datasets"] == {"hospital": "digits:site-a", "cloud": "digits:site-b"}
    assert lineage["metrics"]["test_accuracy"] == summary["test_accuracy"]
    # the final model is the job's parameters: its digest is the one every worker reported
    final = load_checkpoint(model["url"], step=150)
    assert final.framework == spec.framework and final.metrics["test_accuracy"] >= 0.9
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    digests = {m["params_sha256"] for m in metrics if m.get("final")}
    assert len(digests) == 1
    # the job trained on every worker's rows: MODEL.json records the job's total,
    # not the share of the worker that saved the model
    per_worker = [m["train_rows"] for m in metrics if m.get("final") and m.get("process", "").startswith("worker-")]
    assert len(per_worker) == 2 and summary["train_rows"] == sum(per_worker) > max(per_worker)
    assert card["final"]["metrics"]["train_rows"] == summary["train_rows"]
    # registry: the gate passed, so the best model is version 1 of test/digits, alias staging
    registered = model["registered"]
    assert registered["published"] and registered["version"] == 1, registered
    from hybridfleet.registry import Registry

    version = Registry(f"sqlite:///{tmp_path / 'reg.db'}").get_version("test/digits@staging")
    assert version.step == card["best"]["step"] and version.lineage["model"]["which"] == "best"
    assert version.lineage["run_id"] == run_dir.name and version.manifest_sha256


@pytest.mark.torch
def test_registry_block_with_a_failing_gate_publishes_nothing(tmp_path):
    import torch

    from hybridfleet.registry import Registry
    from hybridfleet.registry.publish import publish_run

    # Prepare: a finished run's model whose accuracy misses the gate
    ModelCheckpointer(str(tmp_path / "m"), "torch").final(9, torch.nn.Linear(3, 2), {"test_accuracy": 0.8})
    card = write_model_card(str(tmp_path / "m"), {"job": "j", "run_id": "r1", "metrics": {"test_accuracy": 0.8}})
    url = f"sqlite:///{tmp_path / 'reg.db'}"
    spec = load_spec(small_job(tmp_path, "digits-hybrid.yaml",
                               registry={"publish_as": "t/m", "require": ["test_accuracy>=0.95"], "url": url}))
    # Execute
    out = publish_run(spec, card)
    bad = publish_run(spec.model_copy(update={"registry": spec.registry.model_copy(update={"require": ["acc=>1"]})}), card)
    # Assert
    assert not out["published"] and "test_accuracy=0.8 fails test_accuracy>=0.95" in out["message"]
    assert not bad["published"] and "does not parse" in bad["message"]
    assert Registry(url).list_models() == []


@pytest.mark.torch
def test_model_checkpointer_every_s_and_keep_best_min(tmp_path):
    import torch
    # Prepare
    model = torch.nn.Linear(3, 2)
    ckpt = ModelCheckpointer(str(tmp_path / "m"), "torch", every_s=1e-9, keep_last=1, keep_best="loss:min")
    # Execute
    assert ckpt.after_step(1, model)  # every_s has passed
    assert ckpt.on_metrics(2, model, {"loss": 0.5})
    assert not ckpt.on_metrics(3, model, {"loss": 0.7})  # worse: nothing saved
    assert ckpt.after_step(4, model)
    ckpt.final(5, model, {"loss": 0.9})
    card = write_model_card(str(tmp_path / "m"), {"job": "t"}, "loss:min")
    # Assert: keep_last 1 keeps the final; the best (loss 0.5 at step 2) stays too
    assert sorted(i.step for i in list_checkpoints(str(tmp_path / "m"))) == [2, 5]
    assert card["final"]["step"] == 5 and card["best"]["step"] == 2 and card["best"]["value"] == 0.5


@pytest.mark.torch
def test_model_card_skips_a_corrupt_final_checkpoint(tmp_path):
    import torch
    model = torch.nn.Linear(3, 2)
    root = tmp_path / "m"
    ckpt = ModelCheckpointer(str(root), "torch", keep_last=3)
    ckpt.final(1, model)
    ckpt.final(2, model)
    blob = next((root / "blobs" / "sha256").iterdir())
    for manifest in root.glob("step-000000000002/MANIFEST.json"):
        entry = next(f for f in json.loads(manifest.read_text())["files"] if f["role"] == "model")
        (root / entry["path"]).write_bytes(b"x" * entry["size_bytes"])
    assert blob.exists()
    card = write_model_card(str(root), {})
    # step 2's blob is shared with step 1 (same weights): both fail, so no model
    assert card is None and not (root / CARD_NAME).exists()
    with pytest.raises(CheckpointError, match="no MODEL.json"):
        read_model_card(str(root))


def test_keep_best_must_name_a_metric_and_a_direction():
    assert parse_keep_best("val_loss:min").mode == "min"
    assert parse_keep_best("acc").mode == "max"
    with pytest.raises(SpecError, match="checkpoint.keep_best"):
        parse_keep_best("acc:highest")


@pytest.mark.torch
def test_model_weights_load_into_the_other_framework(tmp_path):
    import paddle
    import torch
    model = torch.nn.Linear(3, 2)
    ModelCheckpointer(str(tmp_path / "m"), "torch").final(7, model)
    target = paddle.nn.Linear(3, 2)
    load_checkpoint(str(tmp_path / "m"), model=target)
    np.testing.assert_allclose(target.weight.numpy(), model.weight.detach().numpy().T)
