"""The demo hybrid job with secure aggregation: real shards, TLS, tokens, torch / paddle training.

Each shard recovers only the sum of a round's pushes and still the model reaches the
demo's accuracy. The torch job's hospital also reduces on its own LAN first
(``aggregate: true``), so its leader masks the site's sum.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from tests.examples import example_job, hybrid_demo

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _run(job: dict, tmp_path: Path, **options) -> tuple[dict, list[dict]]:
    """Run ``job`` from a file under ``tmp_path``: (its summary, every secure-aggregation log event)."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    summary = run_ps_job(load_spec(path), path, echo=False, show_progress=False, run_root=tmp_path / "runs", **options)
    logs = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "runs").rglob("*.log"))
    return summary, [json.loads(line) for line in logs.splitlines() if line.startswith("{") and '"secagg_' in line]


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_the_demo_job_with_secure_aggregation_reaches_the_demo_accuracy(tmp_path, framework):
    job = hybrid_demo(framework)
    if framework == "torch":
        job["sites"]["hospital"]["aggregate"] = True
    job["ps"]["secure_aggregation"] = True
    job["train"].update(site_baselines=False, eval_every_steps=0)
    job.pop("registry", None)

    summary, events = _run(job, tmp_path)

    assert summary["status"] == "completed", summary
    assert summary["test_accuracy"] >= 0.95, summary
    unmasked = [e for e in events if e["event"] == "secagg_unmasked"]
    assert unmasked and all(u["dropped"] == [] for u in unmasked)
    assert {u["shard"] for u in unmasked} == {0, 1}
    assert len(unmasked) >= job["train"]["steps"]  # every round of the job went through the masks
    print(f"{framework}: test accuracy {summary['test_accuracy']} after {len(unmasked)} unmasked shard-rounds")


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_local_sgd_with_secure_aggregation_survives_a_sigkilled_pusher(tmp_path, framework):
    """digits-local (DiLoCo outer rounds) masked; one pusher is SIGKILLed mid-run: the round it misses is
    unmasked from the survivors' pair seeds and it leaves the roster (its return with a fresh key is
    tests/test_secagg_shard.py's)."""
    from tests.ps_helpers import kill_when_round

    job = example_job("digits-local.yaml")
    if framework == "paddle":
        job["framework"], job["entrypoint"] = "paddle", str(REPO / "examples/digits/train_paddle.py")
    job["sites"]["cloud"]["aggregate"] = False  # pushers: the hospital's leader, cloud-0, cloud-1
    job["ps"]["secure_aggregation"] = {"threshold": 2}
    job["train"].update(site_baselines=False)
    job["max_restarts"] = 1
    killed: dict = {}

    summary, events = _run(job, tmp_path, on_started=kill_when_round(5, "worker-cloud-1", killed))

    assert killed["pid"] is not None and summary["status"] == "completed", summary
    assert summary["restarts"] == 1 and summary["test_accuracy"] >= 0.95, summary
    dropped = [e for e in events if e["event"] == "secagg_unmasked" and e["dropped"]]
    assert dropped and all(e["dropped"] == ["cloud-1"] for e in dropped), dropped
    assert any(e["event"] == "secagg_evicted" and e["workers"] == ["cloud-1"] for e in events)
    assert "--- restart 1 ---" in (Path(summary["run_dir"]) / "logs" / "worker-cloud-1.log").read_text()


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_the_demo_job_trains_on_a_sparse_secagg_graph(tmp_path, framework):
    """The demo's four pushers on a ring (degree 2: each pairs with two of the three others; threshold 3
    of its 3 holders against a shard that may lie about dropouts), shrunk to 80 steps: every round of
    both shards is unmasked over that graph and the model learns."""
    job = hybrid_demo(framework)
    job["ps"]["secure_aggregation"] = {"degree": 2, "malicious_shard": True}
    job["train"].update(steps=80, site_baselines=False, eval_every_steps=0)
    job.pop("registry", None)
    job.pop("checkpoint", None)

    summary, events = _run(job, tmp_path)

    assert summary["status"] == "completed", summary
    assert summary["test_accuracy"] >= 0.8, summary
    rosters = [e for e in events if e["event"] == "secagg_roster"]
    assert rosters and all(e["degree"] == 2 and e["threshold"] == 3 and len(e["pushers"]) == 4 for e in rosters)
    unmasked = [e for e in events if e["event"] == "secagg_unmasked"]
    assert {u["shard"] for u in unmasked} == {0, 1} and len(unmasked) >= 2 * 80
    print(f"{framework}: test accuracy {summary['test_accuracy']} after {len(unmasked)} sparse shard-rounds")
