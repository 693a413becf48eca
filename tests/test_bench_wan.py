"""bench/wan.py's workload table, example-job variants, dense step timing and its skip for missing files
(in process; the bench's end-to-end digits run is in test_bench_smoke.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import _wan_workloads as workloads  # noqa: E402

EXAMPLE_JOB = {
    "name": "fashion-hybrid", "framework": "torch", "entrypoint": "examples/fashion/train_torch.py",
    "args": ["--width", "32"], "mode": "ps",
    "sites": {"clinic": {"workers": 2, "data": "examples/fashion/data/site-a"},
              "cloud": {"workers": 2, "data": "examples/fashion/data/site-b"}},
    "ps": {"shards": 2, "sync": "bsp", "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
    "train": {"steps": 400, "batch_size": 64, "seed": 0, "eval_every_steps": 50, "site_baselines": True},
    "security": {"tls": "auto", "tokens": "auto"},
    "checkpoint": {"every_steps": 100}, "registry": {"publish_as": "demo/fashion"}, "max_restarts": 2,
}


def _fake_repo(root: Path, pack_body: str = "") -> None:
    for path in ("examples/fashion/train_torch.py", "examples/fashion/pack_sites.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("")
    (root / "examples/fashion-hybrid.yaml").write_text(yaml.safe_dump(EXAMPLE_JOB))
    (root / "examples/fashion/pack_sites.py").write_text(pack_body)


def test_workload_table_names_scripts_jobs_metric_and_direction():
    fashion, charlm, digits = (workloads.WORKLOADS[n] for n in ("fashion", "charlm", "digits"))
    assert fashion.scripts == {"torch": "examples/fashion/train_torch.py", "paddle": "examples/fashion/train_paddle.py"}
    assert charlm.jobs == {"torch": "examples/charlm-hybrid.yaml", "paddle": "examples/charlm-hybrid-paddle.yaml"}
    assert (fashion.metric, fashion.higher_is_better) == ("test_accuracy", True)
    assert (charlm.metric, charlm.higher_is_better) == ("test_bpc", False)
    assert (digits.target, digits.quick_target) == (0.93, 0.85)
    # the direction decides "reached" and "worse"
    assert charlm.reached(1.9, 2.0) and not charlm.reached(2.1, 2.0) and not charlm.reached(None, 2.0)
    assert fashion.reached(0.91, 0.90) and not fashion.reached(0.89, 0.90)
    assert charlm.worse_by(1.50, 1.53) == pytest.approx(0.03) and fashion.worse_by(0.92, 0.90) == pytest.approx(0.02)


@pytest.mark.torch  # the bench checks its PyTorch anchor before its settings
def test_missing_workload_files_skip_the_bench_naming_them(tmp_path, capsys):
    # Prepare: an empty checkout
    import wan

    args = wan.parse_args(["--workload", "charlm", "--framework", "paddle"])

    # Execute
    with pytest.raises(SystemExit) as exit_info:
        wan.prepare_workload(args, root=tmp_path)

    # Assert: exit 0 with the reason in the JSON line, and nothing written
    assert exit_info.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == {"bench": "wan", "skipped": "workload charlm (paddle) needs examples/charlm/train_paddle.py, "
                                                 "examples/charlm-hybrid-paddle.yaml, examples/charlm/pack_sites.py, "
                                                 "not in this checkout"}
    assert list(tmp_path.iterdir()) == []


def test_an_example_job_becomes_a_valid_variant_job(tmp_path):
    from hybridfleet.spec import parse_spec

    # Execute: local + PowerSGD and the dense anchor, from the same example job
    local = workloads.variant_from_example(EXAMPLE_JOB, "wan-fashion-local-powersgd",
                                           compression={"codec": "powersgd", "rank": 4, "error_feedback": True},
                                           aggregate=True, local_steps=25, eval_every_steps=25, steps=None,
                                           host="10.231.0.1", netns="hf-hosp", root=tmp_path)
    dense = workloads.variant_from_example(EXAMPLE_JOB, "wan-fashion-dense-uncapped", compression={"codec": "none"},
                                           aggregate=False, local_steps=None, eval_every_steps=5, steps=30,
                                           host="10.231.0.1", netns=None, root=tmp_path)

    # Assert: what the variant sets; the job's own script, args and training settings kept; both parse
    assert local["sites"]["clinic"]["netns"] == "hf-hosp" and "netns" not in local["sites"]["cloud"]
    assert local["sites"]["clinic"]["aggregate"] is True and local["sites"]["cloud"]["aggregate"] is True
    assert local["sites"]["clinic"]["data"] == str(tmp_path / "examples/fashion/data/site-a")
    assert local["ps"]["sync"] == "local" and local["ps"]["local_steps"] == 25 and "optimizer" not in local["ps"]
    assert local["ps"]["init_site"] == "cloud" and local["ps"]["host"] == "10.231.0.1"
    assert local["entrypoint"] == str(tmp_path / "examples/fashion/train_torch.py")
    assert local["args"] == ["--width", "32"] and local["train"]["steps"] == 400
    assert local["train"]["eval_every_steps"] == 25 and local["train"]["site_baselines"] is False
    assert not {"checkpoint", "registry", "max_restarts"} & set(local)
    assert dense["ps"]["sync"] == "bsp" and dense["ps"]["optimizer"] == EXAMPLE_JOB["ps"]["optimizer"]
    assert dense["train"]["steps"] == 30 and all("netns" not in s for s in dense["sites"].values())
    assert parse_spec(local).ps.compression.rank == 4
    assert parse_spec(local).ps.optimizer.nesterov is True  # no outer step given: DiLoCo's default
    assert parse_spec(dense).ps.compression.codec == "none"
    assert EXAMPLE_JOB["ps"]["sync"] == "bsp" and "netns" not in EXAMPLE_JOB["sites"]["clinic"]  # input untouched


@pytest.mark.torch  # the bench checks its PyTorch anchor before its settings
def test_the_outer_step_is_set_on_every_local_variant_and_named_in_the_output(tmp_path):
    # Prepare: plain outer averaging (FedAvg's outer step) at H = 200
    import wan

    args = wan.parse_args(["--workload", "fashion", "--local-steps", "200", "--outer-lr", "1", "--outer-momentum", "0"])
    args.example_job, args.job_steps = EXAMPLE_JOB, 400

    # Execute: a local variant, the anchor, and the digits workload's local job
    local, dense = wan.variant_job("local_int4", args, None), wan.variant_job("dense", args, None)
    args.workload = "digits"
    digits = wan.variant_job("local_int4", args, 150)

    # Assert: the local jobs carry the outer step and parse to it; the anchor keeps the job's BSP optimizer
    from hybridfleet.spec import parse_spec

    plain = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False}
    assert args.outer_optimizer == plain
    assert local["ps"]["optimizer"] == plain and local["ps"]["local_steps"] == 200
    assert digits["ps"]["optimizer"] == plain and digits["ps"]["sync"] == "local"
    spec = parse_spec(local).ps.optimizer
    assert (spec.lr, spec.momentum, spec.nesterov) == (1.0, 0.0, False)
    assert dense["ps"]["optimizer"] == EXAMPLE_JOB["ps"]["optimizer"]
    assert wan.describe_outer(plain) == "outer plain averaging (SGD lr 1)"
    assert wan.describe_outer(wan.outer_optimizer(0.7, 0.9)) == "outer Nesterov SGD lr 0.7, momentum 0.9"


@pytest.mark.torch
@pytest.mark.parametrize("flags, message", [
    (["--outer-lr", "0"], "--outer-lr: must be > 0 (got 0.0)"),
    (["--outer-momentum", "1"], "--outer-momentum: must be in [0, 1) (got 1.0)"),
    (["--outer-momentum", "-0.1"], "--outer-momentum: must be in [0, 1) (got -0.1)"),
])
def test_an_outer_step_out_of_range_is_refused(flags, message, capsys):
    import wan

    with pytest.raises(SystemExit) as exit_info:
        wan.parse_args(flags)

    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_missing_site_data_is_packed_with_the_workloads_pack_script(tmp_path):
    # Prepare: a pack script (a real subprocess) that writes each site folder under --out
    _fake_repo(tmp_path, "import sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
                         "[(out / s).mkdir(parents=True) for s in ('site-a', 'site-b')]\n")
    job = workloads.example_job(workloads.WORKLOADS["fashion"], "torch", tmp_path)

    # Execute
    workloads.ensure_packed(job, workloads.WORKLOADS["fashion"], tmp_path)

    # Assert
    assert (tmp_path / "examples/fashion/data/site-a").is_dir() and (tmp_path / "examples/fashion/data/site-b").is_dir()
    assert workloads.missing_files(workloads.WORKLOADS["fashion"], "torch", tmp_path) == []
    assert workloads.site_names(job) == ("clinic", "cloud")


def test_a_pack_script_that_leaves_a_site_missing_is_an_error(tmp_path):
    _fake_repo(tmp_path, "import sys\nprint('no data here', file=sys.stderr)\n")
    job = workloads.example_job(workloads.WORKLOADS["fashion"], "torch", tmp_path)
    with pytest.raises(RuntimeError, match=r"pack_sites.py --out .* exited 0; still missing: .*site-a.*no data here"):
        workloads.ensure_packed(job, workloads.WORKLOADS["fashion"], tmp_path)


def test_an_example_job_without_two_sites_is_refused(tmp_path):
    _fake_repo(tmp_path)
    (tmp_path / "examples/fashion-hybrid.yaml").write_text(yaml.safe_dump({**EXAMPLE_JOB, "sites": {"a": {}}}))
    with pytest.raises(ValueError, match="the WAN bench needs a job with exactly two sites"):
        workloads.example_job(workloads.WORKLOADS["fashion"], "torch", tmp_path)


@pytest.mark.torch  # importing the bench imports its digits job (bench/compression.py)
def test_dense_step_timing_is_the_median_per_step_window_of_the_capped_site(tmp_path):
    # Prepare: two capped workers' records every 5 steps (one slow window), the cloud site's ignored
    import wan

    lines = []
    for process, slow in (("worker-clinic-0", 40), ("worker-clinic-1", None)):
        elapsed = 1.0
        for step in range(0, 45, 5):
            lines.append({"process": process, "site": "clinic", "step": step, "elapsed_s": elapsed,
                          "sent": 1000 + 100 * step, "received": 500 + 100 * step, "ts": elapsed})
            elapsed += 50.0 if step + 5 == slow else 5.0  # 1 s a step, one 10 s window
    lines.append({"process": "worker-cloud-0", "site": "cloud", "step": 5, "elapsed_s": 99.0, "sent": 1, "received": 1,
                  "ts": 1.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))

    # Execute
    step_s, covered, per_step, first, first_bytes = wan.step_timing(path, "clinic")

    # Assert: the median ignores the slow window; bytes per step of both capped workers together
    assert step_s == pytest.approx(1.0) and covered == 40
    assert per_step == pytest.approx(400.0) and first == 0 and first_bytes == 3000


def test_a_variant_that_misses_the_target_is_named_in_the_json_line_and_fails_the_run(tmp_path, capsys):
    # Prepare: every variant reached the target except local + PowerSGD (its final metric is kept)
    import argparse

    import wan

    def reached(time_s, mb, acc):
        return {"time_s": time_s, "step": 50, "bytes": int(mb * 1e6), "link_bytes": int(mb * 1.07e6),
                "final_acc": acc, "wall_s": time_s + 10, "stopped_early": False, "run_dir": str(tmp_path)}

    results = {name: reached(200.0 if name.startswith("dense") else 3.0, 475.0 if name.startswith("dense") else 2.7,
                             0.9667) for name in wan.VARIANTS}
    results["local_powersgd"] = {**reached(0.0, 0.0, 0.5), "time_s": None, "step": None, "bytes": None,
                                 "link_bytes": None}
    one_each = {**EXAMPLE_JOB, "sites": {site: {**conf, "workers": 1} for site, conf in EXAMPLE_JOB["sites"].items()}}
    args = argparse.Namespace(wl=workloads.WORKLOADS["fashion"], workload="fashion", framework="torch", capped="clinic",
                              rate_mbit=20.0, target=0.9, job_steps=150, local_steps=25, rank=4, inner_lr=0.002,
                              example_job=one_each, outer_optimizer=wan.outer_optimizer(1.0, 0.0))
    workdir = tmp_path / "work"
    workdir.mkdir()

    # Execute
    with pytest.raises(SystemExit) as exit_info:
        wan.report(args, results, 19.1, 19.1, workdir)

    # Assert: the JSON line carries every figure, the missed variant's null and named; exit 1, the work kept
    out, err = capsys.readouterr()
    line = json.loads(out.strip().splitlines()[-1])
    assert exit_info.value.code == 1
    assert line["not_reached"] == ["local_powersgd"]
    assert "clinic (1 worker) behind 20 Mbit/s" in out and line["capped_workers"] == 1
    assert "outer plain averaging (SGD lr 1)" in out and line["outer_optimizer"]["momentum"] == 0.0
    assert "H=25, outer plain averaging (SGD lr 1); PowerSGD rank 4;" in out
    assert line["inner_lr"] is None  # an example's local workers step with the script's own optimizer
    assert line["local_powersgd_time_s"] is None and line["local_powersgd_speedup"] is None
    assert line["local_powersgd_final"] == 0.5 and line["local_powersgd_acc_drop"] == pytest.approx(0.4667)
    assert line["local_speedup"] == pytest.approx(200.0 / 3.0, rel=1e-3) and line["local_acc_drop"] == 0.0
    assert "FAILED: target 0.9 not reached within 150 steps by: local_powersgd" in err
    assert workdir.exists()


def test_variants_left_out_by_variants_keep_their_keys_null_and_are_not_counted_as_missed(tmp_path, capsys):
    # Prepare: only the anchor and local + int4 ran (--variants dense,local_int4), both reaching the target
    import argparse

    import wan

    def reached(time_s, mb, acc):
        return {"time_s": time_s, "step": 10, "bytes": int(mb * 1e6), "link_bytes": int(mb * 1.07e6),
                "final_acc": acc, "wall_s": time_s + 10, "stopped_early": False, "run_dir": str(tmp_path)}

    results = {"dense": reached(12.0, 28.5, 0.60), "local_int4": reached(6.0, 1.3, 0.72)}
    args = argparse.Namespace(wl=workloads.WORKLOADS["digits"], workload="digits", framework="torch",
                              capped="hospital", rate_mbit=100.0, target=0.3, job_steps=10, local_steps=10, rank=4,
                              inner_lr=0.002, outer_optimizer=wan.outer_optimizer(0.7, 0.9))
    workdir = tmp_path / "work"
    workdir.mkdir()

    # Execute
    wan.report(args, results, 95.0, 95.0, workdir)

    # Assert: the ratios of the two that ran; every key of the others null; only the two rows in the table
    out, _ = capsys.readouterr()
    line = json.loads(out.strip().splitlines()[-1])
    assert line["variants"] == ["dense", "local_int4"] and line["not_reached"] == []
    assert "hospital (2 workers) behind 100 Mbit/s" in out and line["capped_workers"] == 2
    assert line["inner_lr"] == 0.002  # digits' local workers: Adam at --inner-lr
    assert "outer Nesterov SGD lr 0.7, momentum 0.9" in out and line["outer_optimizer"]["nesterov"] is True
    assert line["local_speedup"] == 2.0 and line["local_bytes_reduction"] == pytest.approx(1 - 1.3 / 28.5, abs=1e-5)
    assert line["compressed_s"] is None and line["speedup"] is None and line["local_vs_topk"] is None
    assert line["dense_per_worker_bytes"] is None and line["local_powersgd_final"] is None
    assert "[anchor]" in out and "(DiLoCo) int4" in out and "per-worker push" not in out and "(DiLoCo) int8" not in out
    assert "PowerSGD rank" not in out  # the header names only the settings of the variants that ran
    assert not workdir.exists()  # a complete run leaves nothing behind
