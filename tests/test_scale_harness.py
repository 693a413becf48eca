"""bench/scale.py at N = 50: real shard processes with TLS and tokens, 50 simulated workers in
client processes, the lost / double-applied check against the replayed log of accepted pushes.

The figures are never asserted (they are the bench's to report); the checks are: the keys are
there, no push was lost or applied twice, every live worker holds the same parameters, and the
check itself notices a push missing from, or added to, the log it replays. Both frameworks'
server-side optimizer numerics run (torch in the sweep test, Paddle in the churn test); the
simulated workers are numpy clients, so neither framework needs to be installed.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import scale  # noqa: E402

NUMEL = 200_000  # a small model: 2 ledgers of 5,000 elements and 190,000 others
KEYS = ("round_p50_s", "round_p99_s", "shard_cpu_s_per_round", "shard_rss_kib", "bytes_per_worker",
        "lost_pushes", "double_applied", "workers_agree")


@pytest.mark.slow
def test_fifty_workers_on_two_shards_lose_no_push_and_agree_and_the_check_sees_a_tampered_log(tmp_path):
    # Prepare / Execute: N = 50 (two client processes), S = 2, top-k 1% + EF, BSP
    result = scale.measure(tmp_path, 50, 2, "topk", "bsp", 2, NUMEL, 25, keep_evidence=True)

    # Assert: every figure is there and measured; nothing lost, nothing doubled, one digest
    for key in KEYS:
        assert key in result, key
    assert result["round_p50_s"] > 0 and result["shard_cpu_s_per_round"] > 0
    assert result["shard_rss_kib"] > 0 and result["bytes_per_worker"] > 0
    assert result["client_processes"] == 2
    assert result["lost_pushes"] == 0 and result["double_applied"] == 0
    assert result["live_workers"] == 50 and result["workers_agree"] is True
    evidence = result["evidence"]
    pushes = sum(len(e) for e in evidence["accepted"].values())
    assert pushes == 50 * 2 * 3  # 50 workers x 2 shards x (a warm-up round + 2 timed rounds), all acknowledged
    # the check can fail: a push dropped from the log reads as applied once too often ...
    dropped = copy.deepcopy(evidence)
    dropped["accepted"]["site00-7"].pop()
    assert scale.check(dropped)["double_applied"] == 1
    # ... and one the log holds twice, but the shard applied once, as lost
    doubled = copy.deepcopy(evidence)
    doubled["accepted"]["site00-7"].append(doubled["accepted"]["site00-7"][0])
    assert scale.check(doubled)["lost_pushes"] == 1
    # a worker whose values differ breaks the agreement
    split = copy.deepcopy(evidence)
    split["finals"][0]["digests"]["site00-3"] = "0" * 64
    assert scale.check(split)["workers_agree"] is False


@pytest.mark.slow
def test_churn_of_leaves_rejoins_and_a_sigkilled_client_process_loses_no_push(tmp_path):
    # Prepare / Execute: 50 workers, one client process SIGKILLed mid-round and restarted;
    # a fast churn rate so every kind of event happens within 20 s (Paddle's SGD on the shards)
    result = scale.churn_run(tmp_path, 50, 20.0, NUMEL, 25, rate_per_min=1.5, framework="paddle")

    # Assert
    kinds = [e["kind"] for e in result["events"]]
    assert {"leave", "rejoin", "kill", "restart"} <= set(kinds), kinds
    assert result["lost_pushes"] == 0 and result["double_applied"] == 0
    assert result["workers_agree"] is True
    assert result["live_workers"] >= 48  # at most one worker is away (left) at the end


def test_bench_last_line_carries_the_issue_keys(tmp_path, monkeypatch, capsys):
    # Prepare: the sweep replaced by one canned configuration, to check only the report's shape
    canned = {"n": 10, "shards": 4, "codec": "topk", "sync": "bsp", "rounds": 1, "round_p50_s": 0.1,
              "round_p99_s": 0.2, "shard_cpu_s_per_round": 0.05, "shard_rss_kib": 1000, "bytes_per_worker": 10,
              "lost_pushes": 0, "double_applied": 0, "workers_agree": True}
    monkeypatch.setattr(scale, "measure", lambda workdir, n, *a, **k: {**canned, "n": n,
                                                                         "round_p50_s": 0.1 + n * 1e-3,
                                                                         "shard_rss_kib": 1000 + 2 * n})
    monkeypatch.setattr(sys, "argv", ["scale.py", "--n", "10", "1000", "--shards", "4", "--codecs", "topk",
                                      "--sync", "bsp", "--no-churn"])

    # Execute
    scale.main()

    # Assert: the slopes are fitted over N; the N = 1000 figure is reported
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("per_worker_round_us", "per_worker_rss_kib", "round_p99_s_n1000", "lost_pushes", "double_applied"):
        assert key in out, key
    assert out["per_worker_round_us"] == pytest.approx(1000.0)
    assert out["per_worker_rss_kib"] == pytest.approx(2.0)
    assert out["round_p99_s_n1000"] == 0.2
