"""Model buffers (BatchNorm statistics, counters) follow ``ps.buffers``: average, broadcast or local."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.session import WorkerConfig
from hybridfleet.ps.server.serve import server_security, start_shard
from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
from hybridfleet.spec import parse_spec
from tests.ps_helpers import Cluster
from tests.buffer_models import batch, buffer_names, copy_model, loss, make_model, sgd, state

FRAMEWORKS = [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)]
LR = 0.1


def _connect(framework: str):
    if framework == "torch":
        import hybridfleet.torch as hf
    else:
        import hybridfleet.paddle as hf
    return hf.connect


class Job:
    """Shards on 127.0.0.1 (TLS, tokens) for one job, and worker configs for it."""

    def __init__(self, tmp_path, framework: str, sites: dict, **ps):
        self.spec = parse_spec({
            "name": "buffers", "framework": framework, "entrypoint": "train.py", "sites": sites,
            "ps": {"shards": 1, "sync": "bsp", "optimizer": {"name": "sgd", "lr": LR},
                   "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, **ps}})
        self.certs = tmp_path / "certs"
        make_dev_pki(self.certs)
        generate_signing_key(self.certs)
        workers = sum(s["workers"] for s in sites.values())
        self.servers = [start_shard(self.spec, i, "127.0.0.1", 0, server_security(self.spec, self.certs), workers)
                        for i in range(self.spec.ps.shards)]
        self.issuer = TokenIssuer.from_dir(self.certs)
        self.cluster = Cluster(self.spec, self.certs, self.issuer, self.servers)

    def config(self, site: str, rank: int) -> WorkerConfig:
        token = self.issuer.issue(self.spec.name, site, "worker", 600, worker=f"{site}-0")
        sec = ClientSecurity.from_files(str(load_pki(self.certs).ca_cert), token=token)
        return WorkerConfig(job=self.spec, site=site, rank=rank, servers=[s.address for s in self.servers],
                            security=sec)

    def shard_state(self) -> dict[str, np.ndarray]:
        return self.cluster.params()

    def stop(self) -> None:
        self.cluster.stop()


def _run_workers(job: Job, framework: str, plan: dict[str, dict], steps: int):
    """Train one worker per site in threads; each records, before its last step, what its own
    BatchNorm update of the job's buffers would be (a copy of its model run on its batch)."""
    handles, models, local_update, errors = {}, {}, {}, []

    def train(site: str, rank: int) -> None:
        try:
            models[site] = make_model(framework)
            ps = handles[site] = _connect(framework)(models[site], config=job.config(site, rank))
            for step in range(steps):
                x, y = batch(100 * rank + step, plan[site]["n"], plan[site]["shift"])
                if step == steps - 1:
                    alone = copy_model(framework, models[site])
                    loss(framework, alone, x, y)  # training-mode forward: the local BatchNorm update
                    local_update[site] = state(framework, alone)
                ps.zero_grad()
                loss(framework, models[site], x, y).backward()
                ps.step()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            errors.append(err)

    threads = [threading.Thread(target=train, args=(site, rank)) for rank, site in enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return handles, models, local_update


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_worker_matches_the_plain_script_with_its_batchnorm_statistics(tmp_path, framework):
    # Prepare: the plain script (its own SGD) and a job of one worker, one shard, dense, BSP, server SGD
    plain = make_model(framework)
    opt = sgd(framework, plain, LR)
    job = Job(tmp_path, framework, {"a": {"workers": 1}})
    model = make_model(framework)
    try:
        ps = _connect(framework)(model, config=job.config("a", 0))
        # Execute: 20 steps each
        for step in range(20):
            x, y = batch(step, 16, shift=1.0)
            opt.clear_grad() if framework == "paddle" else opt.zero_grad()
            loss(framework, plain, x, y).backward()
            opt.step()
            ps.zero_grad()
            loss(framework, model, x, y).backward()
            ps.step()
        ps.close()
    finally:
        job.stop()
    # Assert: parameters and buffers within 1e-5 of the plain script's (the counter exactly)
    expected, got = state(framework, plain), state(framework, model)
    assert set(buffer_names(framework)) <= set(got)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if framework == "torch":
        assert got["1.num_batches_tracked"] == expected["1.num_batches_tracked"] == 20


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_average_gives_the_sample_weighted_mean_of_each_site_update_and_the_saved_model_holds_it(
        tmp_path, framework, monkeypatch):
    # Prepare: two sites whose inputs differ in brightness, 8 and 24 samples a step; rank 0 saves the model
    monkeypatch.setenv("HFLEET_MODEL_DIR", str(tmp_path / "model"))
    job = Job(tmp_path, framework, {"a": {"workers": 1}, "b": {"workers": 1}})
    plan = {"a": {"n": 8, "shift": 0.0}, "b": {"n": 24, "shift": 2.0}}
    try:
        # Execute
        handles, models, local = _run_workers(job, framework, plan, steps=3)
        handles["a"].report(final=True)
        for h in handles.values():
            h.close()
    finally:
        job.stop()
    # Assert: both workers hold the weighted mean of the two local updates of the last step
    from hybridfleet.ckpt.reader import list_steps, read_checkpoint
    from hybridfleet.store import open_store

    store = open_store(str(tmp_path / "model"))
    saved = read_checkpoint(store, list_steps(store)[-1])[2]["model"]
    for name in buffer_names(framework):
        expected = (8 * local["a"][name].astype(np.float64) + 24 * local["b"][name]) / 32
        if name.endswith("num_batches_tracked"):
            expected = np.rint(expected)
        assert not np.allclose(local["a"][name], local["b"][name]) or name.endswith("num_batches_tracked")
        for site in plan:
            np.testing.assert_allclose(state(framework, models[site])[name], expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{site} {name}")
        np.testing.assert_allclose(saved[name], expected, rtol=1e-5, atol=1e-6, err_msg=f"saved {name}")
    assert handles["a"].session.params_digest() == handles["b"].session.params_digest()


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("policy", ["broadcast", "local"])
def test_broadcast_gives_rank_zeros_statistics_and_local_keeps_each_sites(tmp_path, framework, policy):
    # Prepare
    job = Job(tmp_path, framework, {"a": {"workers": 1}, "b": {"workers": 1}}, buffers=policy)
    plan = {"a": {"n": 8, "shift": 0.0}, "b": {"n": 24, "shift": 2.0}}
    try:
        # Execute
        handles, models, local = _run_workers(job, framework, plan, steps=3)
        shard = job.shard_state()
        for h in handles.values():
            h.close()
    finally:
        job.stop()
    # Assert: broadcast: every worker holds rank 0's (site a's) update; local: each its own, nothing on the shard
    for name in buffer_names(framework):
        for site in plan:
            want = local["a" if policy == "broadcast" else site][name]
            np.testing.assert_allclose(state(framework, models[site])[name], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{policy} {site} {name}")
    assert any(k.startswith("buffer:") for k in shard) == (policy == "broadcast")
    # the parameters are the job's either way
    params = [{k: v for k, v in state(framework, models[s]).items() if k not in buffer_names(framework)} for s in plan]
    for k in params[0]:
        np.testing.assert_array_equal(params[0][k], params[1][k])


def test_an_unknown_policy_is_refused_naming_the_field_and_the_choices():
    from hybridfleet.errors import SpecError

    with pytest.raises((SpecError, ValueError)) as err:
        parse_spec({"name": "b", "framework": "torch", "entrypoint": "train.py", "sites": {"a": {"workers": 1}},
                    "ps": {"buffers": "median"}})
    text = str(err.value)
    assert "ps.buffers" in text and "average" in text and "local" in text and "broadcast" in text


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_buffer_of_another_shape_is_refused_at_join_and_at_push_and_nothing_changes(tmp_path, framework):
    # Prepare: rank 0 joins with a 3-element buffer and takes one step
    job = Job(tmp_path, framework, {"a": {"workers": 1}, "b": {"workers": 1}}, sync="asp")
    model = make_model(framework, extra_buffer=3)
    try:
        ps = _connect(framework)(model, config=job.config("a", 0))
        x, y = batch(0, 8)
        loss(framework, model, x, y).backward()
        ps.step()
        shard_before, model_before, steps_before = job.shard_state(), state(framework, model), ps.step_count
        # Execute + Assert: a worker whose buffer holds 4 elements is refused at join, naming it
        with pytest.raises(Exception) as err:
            _connect(framework)(make_model(framework, extra_buffer=4), config=job.config("b", 1))
        assert "buffer:scale" in str(err.value) and "(4" in str(err.value)
        assert set(job.servers[0].state.members) == {"a-0"}
        # Execute + Assert: the script swaps in a buffer of another shape: that step is refused, nothing sent
        if framework == "torch":
            import torch

            model.scale = torch.ones(5)
        else:
            import paddle

            model.register_buffer("scale", paddle.ones([5]))
        loss(framework, model, x, y).backward()
        with pytest.raises(ValueError, match=r"buffer 'scale' has shape \(5,\), the job's is \(3,\); nothing was sent"):
            ps.step()
        after = job.shard_state()
        assert ps.step_count == steps_before
        for k in shard_before:
            np.testing.assert_array_equal(after[k], shard_before[k], err_msg=k)
        now = state(framework, model)  # the parameters stay (the forward pass moved the statistics, as it would)
        for k in set(model_before) - set(buffer_names(framework)) - {"scale"}:
            np.testing.assert_array_equal(now[k], model_before[k], err_msg=k)
        ps.close()
    finally:
        job.stop()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_averaging_statistics_under_a_robust_rule_is_refused_at_connect_before_joining(tmp_path, framework):
    from hybridfleet.errors import SpecError

    # Prepare: a job whose shards take the median of a round's updates
    job = Job(tmp_path, framework, {"a": {"workers": 1}}, aggregate="median")
    try:
        # Execute
        with pytest.raises(SpecError, match="ps.buffers: average with this model's buffers .*median.*"
                                            "set ps.buffers: local"):
            _connect(framework)(make_model(framework), config=job.config("a", 0))
        # Assert: nothing joined, nothing initialised
        status = job.servers[0].state.status()
        assert status["live_workers"] == [] and not status["initialized"]
    finally:
        job.stop()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_local_sgd_rounds_carry_the_statistics_of_the_inner_steps(tmp_path, framework):
    # Prepare: sync local, 3 inner steps a round; the plain script takes the same 3 inner steps
    job = Job(tmp_path, framework, {"a": {"workers": 1}}, sync="local", local_steps=3)
    plain, model = make_model(framework), make_model(framework)
    plain_opt = sgd(framework, plain, LR)
    try:
        ps = _connect(framework)(model, sgd(framework, model, LR), config=job.config("a", 0))
        # Execute: one outer round
        for step in range(3):
            x, y = batch(step, 16, shift=1.0)
            for m, opt in ((plain, plain_opt), (model, ps.optimizer)):
                opt.clear_grad() if framework == "paddle" else opt.zero_grad()
                loss(framework, m, x, y).backward()
                if m is plain:
                    opt.step()
                else:
                    ps.step()
        shard = job.shard_state()
        ps.close()
    finally:
        job.stop()
    # Assert: the round's statistics (one worker: its own) are the job's, on the shard and in the model
    expected, got = state(framework, plain), state(framework, model)
    for name in buffer_names(framework):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(shard[f"buffer:{name}"][:-1], np.asarray(expected[name], np.float32).reshape(-1),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_statistics_travel_dense_under_a_sparse_codec_both_ways(tmp_path, framework):
    # Prepare: top-k 10% with error feedback, so the downlink sends codec-encoded deltas too
    job = Job(tmp_path, framework, {"a": {"workers": 1}, "b": {"workers": 1}},
              compression={"codec": "topk", "ratio": 0.1, "error_feedback": True})
    plan = {"a": {"n": 8, "shift": 0.0}, "b": {"n": 24, "shift": 2.0}}
    try:
        # Execute
        handles, models, local = _run_workers(job, framework, plan, steps=3)
        shard = job.shard_state()
        for h in handles.values():
            h.close()
    finally:
        job.stop()
    # Assert: every coordinate of every statistic is the weighted mean, on the shard and on both workers
    for name in buffer_names(framework):
        expected = (8 * local["a"][name].astype(np.float64) + 24 * local["b"][name]) / 32
        expected = np.rint(expected) if name.endswith("num_batches_tracked") else expected
        np.testing.assert_allclose(shard[f"buffer:{name}"][:-1], np.reshape(expected, -1), rtol=1e-5, atol=1e-6)
        for site in plan:
            np.testing.assert_allclose(state(framework, models[site])[name], expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{site} {name}")
