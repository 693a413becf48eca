"""Differential privacy of pushes (hybridfleet.privacy): clipping, noise, accountant, budget, summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.errors import SpecError
from hybridfleet.privacy import GaussianMechanism, epsilon_spent, steps_within_budget
from hybridfleet.spec import parse_spec
from tests.examples import hybrid_demo

REPO = Path(__file__).resolve().parents[1]


def test_the_whole_update_is_clipped_to_the_norm_before_noise():
    mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=1e-9, seed=0)
    update = {"w": np.full(100, 3.0, np.float32), "b": np.full(4, 4.0, np.float32)}
    out = mech.apply(update)
    norm = np.sqrt(sum(float((v ** 2).sum()) for v in out.values()))
    assert norm == pytest.approx(1.0, rel=1e-5) and mech.clipped == 1
    assert np.allclose(update["w"], 3.0)  # the caller's arrays are left as they are
    small = {"w": np.full(4, 0.1, np.float32)}
    assert np.allclose(mech.apply(small)["w"], 0.1, atol=1e-6) and mech.clipped == 1


def test_the_noise_has_the_calibrated_standard_deviation():
    mech = GaussianMechanism(clip_norm=2.0, noise_multiplier=1.5, seed=1)
    out = mech.apply({"w": np.zeros(200_000, np.float32)})["w"]
    assert out.std() == pytest.approx(3.0, rel=0.01) and abs(out.mean()) < 0.02


def test_epsilon_grows_with_rounds_and_the_budget_gives_the_last_round_within_it():
    eps = [epsilon_spent(1.0, t, 1e-5) for t in (1, 10, 100)]
    assert eps[0] < eps[1] < eps[2]
    allowed = steps_within_budget(1.0, 1e-5, 50.0, 1000)
    assert epsilon_spent(1.0, allowed, 1e-5) <= 50.0 < epsilon_spent(1.0, allowed + 1, 1e-5)
    assert steps_within_budget(1.0, 1e-5, 1e6, 40) == 40


def test_a_budget_spent_by_one_round_is_refused_with_the_fix():
    with pytest.raises(SpecError, match=r"epsilon_budget: 0.01 is spent by a single round .* raise noise_multiplier"):
        steps_within_budget(0.5, 1e-5, 0.01, 100)


@pytest.mark.parametrize("privacy, message", [
    ({"noise_multiplier": 1.0}, "ps.privacy.clip_norm"),
    ({"clip_norm": 1.0, "noise_multiplier": 0}, "ps.privacy.noise_multiplier"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 2}, "ps.privacy.delta"),
])
def test_bad_privacy_settings_name_the_field(privacy, message):
    job = {"name": "j", "framework": "torch", "entrypoint": "t.py", "sites": {"a": {}}, "ps": {"privacy": privacy}}
    with pytest.raises(SpecError, match=message):
        parse_spec(job)


@pytest.mark.slow
@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_a_private_job_stops_at_its_budget_and_reports_epsilon_and_accuracy(tmp_path, framework):
    from hybridfleet.launch.psjob import run_ps_job
    from hybridfleet.spec import load_spec

    job = hybrid_demo(framework)
    job["ps"]["privacy"] = {"clip_norm": 1.0, "noise_multiplier": 0.6, "delta": 1e-5, "epsilon_budget": 200.0}
    job["ps"]["optimizer"] = {"name": "sgd", "lr": 0.1, "momentum": 0.9}  # momentum averages the noise out
    job["train"].update(site_baselines=False, eval_every_steps=0)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    allowed = steps_within_budget(0.6, 1e-5, 200.0, job["train"]["steps"])
    assert allowed < job["train"]["steps"]  # the budget, not the step count, ends this job

    summary = run_ps_job(load_spec(path), path, echo=False, show_progress=False, run_root=tmp_path / "runs")

    assert summary["status"] == "completed", summary
    assert set(summary["privacy_by_site"]) == {"hospital", "cloud"}
    for spent in summary["privacy_by_site"].values():
        assert spent["epsilon"] == pytest.approx(epsilon_spent(0.6, allowed, 1e-5), rel=1e-6)
        assert spent["epsilon"] <= 200.0 and spent["delta"] == 1e-5
    assert summary["test_accuracy"] is not None and summary["test_accuracy"] > 0.2  # better than chance (0.1)
    print(f"{framework}: epsilon {summary['privacy_by_site']['hospital']['epsilon']:.1f} after {allowed} rounds, "
          f"test accuracy {summary['test_accuracy']}")
