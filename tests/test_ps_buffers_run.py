"""`hfleet run` of the BatchNorm CNN examples: the summary's joint accuracy is the saved model's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt.checkpoint import load_checkpoint
from hybridfleet.ckpt.run_model import read_model_card
from hybridfleet.ckpt.site_buffers import read_site_buffers
from hybridfleet.errors import CheckpointError
from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from tests.test_ps_run import _job

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "digits"))


def _cnn(framework: str):
    """The examples' CNN (examples/digits/train_cnn_*.py), fresh."""
    if framework == "torch":
        import torch

        nn = torch.nn
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.1), nn.Linear(128, 10))
    import paddle

    nn = paddle.nn
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2D(1, 8, 3, padding=1), nn.BatchNorm2D(8), nn.ReLU(),
                         nn.MaxPool2D(2), nn.Flatten(), nn.Dropout(0.1), nn.Linear(128, 10))


def _accuracy(framework: str, model) -> float:
    from digits_data import load_test

    x, y = load_test()
    model.eval()
    if framework == "torch":
        import torch

        with torch.no_grad():
            return (model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y)).float().mean().item()
    import paddle

    with paddle.no_grad():
        return float((model(paddle.to_tensor(x)).argmax(1) == paddle.to_tensor(y)).astype("float32").mean())


@pytest.mark.parametrize(("example", "framework", "policy"), [
    ("digits-cnn.yaml", "torch", "average"), ("digits-cnn-paddle.yaml", "paddle", "local")])
def test_reported_joint_accuracy_is_the_saved_models_evaluated_accuracy(tmp_path, example, framework, policy):
    # Prepare: the example job, shortened
    job = _job(tmp_path, example, train__steps=30, train__eval_every_steps=15, ps__buffers=policy)
    spec = load_spec(job)
    # Execute
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs", report=False)
    # Assert: evaluating the saved final model gives exactly the summary's joint accuracy
    assert summary["status"] == "completed", summary
    model = _cnn(framework)
    load_checkpoint(summary["model"]["url"], model=model, step=summary["model"]["final_step"], restore_rng=False)
    assert round(_accuracy(framework, model), 5) == summary["test_accuracy"]
    assert summary["test_accuracy_source"].startswith("the saved model")
    assert summary["test_accuracy"] > 0.5  # it trained
    by_worker = summary["test_accuracy_by_worker"]
    card = read_model_card(summary["model"]["url"])
    if policy == "average":  # one model: every worker evaluates the same; no site keeps statistics of its own
        assert len(set(by_worker.values())) == 1, by_worker
        assert card["site_buffers"] == {}
        return
    # local (FedBN): each site's statistics are saved next to the model, which holds rank 0's site's
    assert set(card["site_buffers"]) == {"hospital", "cloud"}
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    saver = next(r["site"] for r in records if r.get("final") and r.get("rank") == 0)
    other = next(s for s in ("hospital", "cloud") if s != saver)
    own = read_site_buffers(summary["model"]["url"], saver)
    theirs = read_site_buffers(summary["model"]["url"], other)
    assert set(own) == {"2._mean", "2._variance"}
    saved = {k: np.array(v.numpy()) for k, v in model.state_dict().items()}
    for name, value in own.items():
        np.testing.assert_array_equal(saved[name], value)
        assert not np.allclose(value, theirs[name]), name  # the sites' images differ, so do their statistics
    with pytest.raises(CheckpointError, match="no buffers of site 'lab'.*cloud, hospital"):
        read_site_buffers(summary["model"]["url"], "lab")
