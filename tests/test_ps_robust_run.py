"""A poisoning site in a real `hfleet run` job: the plain mean collapses, a robust rule does not.

Five sites, one worker each: four honest ones (two with the mostly-0-4 rows, two with
the mostly-5-9 rows) and an attacker that pushes its gradients scaled by -1000
(tests/poison_train.py). A coordinate-wise rule needs an honest majority that spans
the data: with two non-IID honest sites the median follows one of them. Real shards, TLS,
tokens and torch / paddle training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, framework: str, aggregate: str, monkeypatch) -> dict:
    monkeypatch.setenv("HFLEET_TEST_POISON_SITE", "attacker")
    monkeypatch.setenv("HFLEET_TEST_POISON_SCALE", "-1000")
    script = "train_torch.py" if framework == "torch" else "train_paddle.py"
    job = {
        "name": f"poison-{aggregate}", "framework": framework, "mode": "ps",
        "entrypoint": str(REPO / "tests/poison_train.py"), "args": [str(REPO / "examples/digits" / script)],
        "sites": {"hospital": {"workers": 1, "data": "digits:site-a"}, "cloud": {"workers": 1, "data": "digits:site-b"},
                  "clinic": {"workers": 1, "data": "digits:site-a"}, "lab": {"workers": 1, "data": "digits:site-b"},
                  "attacker": {"workers": 1, "data": "digits:site-b"}},
        "ps": {"shards": 1, "sync": "bsp", "aggregate": aggregate, "optimizer": {"name": "adam", "lr": 0.003},
               "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10},
        "train": {"steps": 300, "batch_size": 32, "seed": 0, "site_baselines": False},
        "max_restarts": 0,
    }
    path = tmp_path / f"{aggregate}.yaml"
    path.write_text(yaml.safe_dump(job))
    return run_ps_job(load_spec(path), path, echo=False, show_progress=False, run_root=tmp_path / "runs")


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_a_poisoning_site_collapses_the_mean_but_not_the_median(tmp_path, framework, monkeypatch):
    plain = run(tmp_path, framework, "mean", monkeypatch)
    robust = run(tmp_path, framework, "median", monkeypatch)
    assert plain["status"] == robust["status"] == "completed"
    honest = {n: a for n, a in robust["test_accuracy_by_worker"].items() if "attacker" not in n}
    assert min(honest.values()) >= 0.93, robust
    assert max(a for n, a in plain["test_accuracy_by_worker"].items() if "attacker" not in n) < 0.5, plain
