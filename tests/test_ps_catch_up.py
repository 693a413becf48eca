"""A worker whose rounds closed without it catches up, and its script's loop ends with the job's rounds.

Worker b falls out of the quorum (its heartbeats held back until the shard times it out), the other
worker closes three rounds alone, then b's heartbeats resume and it trains on: its first push is
refused as stale, it takes up the open round (`caught_up`), trains the job's remaining rounds with
the other worker, and the steps its loop still counts past ``train.steps`` change nothing: no push,
no optimizer step, no round past the job's last one. Scripts that then train on past ``train.steps``
on purpose do so together (b leaves out only as many steps as rounds it missed). Real TLS shards,
real torch / paddle models.

The same holds when the connection drops while b's catch-up pull is sent (the shard closes it with
the frame cut short, as it does when the values it sends from change): b joins the shard again
and still takes up the open round.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hybridfleet.ps.server import bulk_server, downlink
from tests.script_optim_helpers import job, run_workers, start_shards

STEPS = 6


def _framework(framework: str):
    """(connect, a model and its SGD optimizer, one forward-backward of a fixed batch) for ``framework``."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)
    if framework == "torch":
        import torch

        import hybridfleet.torch as hf

        def build():
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            return model, torch.optim.SGD(model.parameters(), lr=0.1)

        def backward(model):
            torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()

        return hf.connect, build, backward
    import paddle

    import hybridfleet.paddle as hf

    def build():
        paddle.seed(0)
        model = paddle.nn.Linear(3, 2)
        return model, paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())

    def backward(model):
        paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()

    return hf.connect, build, backward


def _values(handle) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32).reshape(-1) for k, v in handle.session.parameters().items()}


def _live(shards) -> int:
    return len(shards.status()[0]["live_workers"])


def _b_falls_behind(shards, connect, build, backward):
    """Two workers join; b goes silent until the shard drops it, a closes three rounds alone, then
    b's heartbeats resume. Returns ((a, its model), (b, its model))."""
    def join(rank):
        model, opt = build()
        return connect(model, opt, shards.config(rank)), model

    (a, a_model), (b, b_model) = run_workers(join, 2, timeout_s=60)
    client = b.session.client
    client._hb_stop.set()
    deadline = time.monotonic() + 20
    while _live(shards) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live(shards) == 1
    for _ in range(3):
        a.zero_grad()
        backward(a_model)
        a.step()
    client._hb_stop.clear()  # b's heartbeats resume
    client._hb_thread = threading.Thread(target=client._heartbeat_loop, args=(0.2,), daemon=True)
    client._hb_thread.start()
    return (a, a_model), (b, b_model)


def _run_loops(backward, *runs) -> None:
    """Run each ``(handle, model, first step)`` as a script's ``for step in range(first, STEPS)``, each in
    its own thread; a loop still waiting after 120 s (for a round nobody pushes) fails the test."""
    def loop(i):
        handle, model, start = runs[i]
        for _ in range(start, STEPS):
            handle.zero_grad()
            backward(model)
            handle.step()

    run_workers(loop, len(runs), timeout_s=120)


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_a_caught_up_worker_takes_no_step_past_the_jobs_last_round(tmp_path, framework):
    # Prepare: two workers of one site on a real shard, a six-step job
    connect, build, backward = _framework(framework)
    spec = job(framework, workers=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    spec.train.steps = STEPS
    shards = start_shards(tmp_path, spec)
    try:
        (a, a_model), (b, b_model) = _b_falls_behind(shards, connect, build, backward)
        b_start = b.step_count
        b.zero_grad()  # b's next step: refused as stale (its rounds closed without it), so b takes up round 3
        backward(b_model)
        b.step()
        assert b.session.caught_up == 2 and b.step_count == 3 and shards.status()[0]["version"] == 3

        # Execute: both scripts run their loops to the job's end, as `for step in range(ps.step_count, steps)`
        _run_loops(backward, (a, a_model, a.step_count), (b, b_model, b_start + 1))
        final = shards.params()

        # Assert: the job ran its six rounds and no more (b's loop counted as many steps past them as rounds
        # closed without it: two, or more where a closed rounds before b's next call re-admitted it), and
        # both workers hold the job's final model: b's steps past the last round took no optimizer step
        assert b.session.caught_up >= 2 and b.step_count == STEPS and a.step_count == STEPS
        assert shards.status()[0]["version"] == STEPS
        for values in (_values(a), _values(b)):
            assert set(values) == set(final)
            for k in final:
                np.testing.assert_array_equal(values[k], final[k].reshape(-1), err_msg=k)

        # Execute: scripts that train past train.steps on purpose go on together: b leaves out only the
        # steps its loop counted for the rounds it missed, so neither waits for the other
        _run_loops(backward, (a, a_model, 0), (b, b_model, 0))
        # Assert: both pushed rounds 6 to 11 (version 12), and hold the same parameters
        assert shards.status()[0]["version"] == 2 * STEPS and a.step_count == b.step_count == 2 * STEPS
        again = shards.params()
        for values in (_values(a), _values(b)):
            for k in again:
                np.testing.assert_array_equal(values[k], again[k].reshape(-1), err_msg=k)
        a.close()
        b.close()
    finally:
        shards.stop()


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_a_worker_whose_catch_up_pull_is_cut_rejoins_and_takes_up_the_open_round(tmp_path, monkeypatch, framework):
    # Prepare: b falls out of the quorum as above; the shard cuts the first pull it sends once armed
    # (half of the first piece, then the connection closes: what a lost connection leaves the worker)
    connect, build, backward = _framework(framework)
    spec = job(framework, workers=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    spec.train.steps = STEPS
    shards = start_shards(tmp_path, spec)
    cut = {"armed": False, "done": 0}
    real_send = downlink.send_values

    def cutting(sendall, items):
        pieces = [p for _, chunk, _, _ in items for p in chunk if len(p)]
        if cut["armed"] and pieces and not cut["done"]:
            cut["done"] += 1
            sendall(pieces[0][:max(len(pieces[0]) // 2, 1)])
            raise downlink.ValuesChanged("cut by the test")
        return real_send(sendall, items)

    monkeypatch.setattr(bulk_server, "send_values", cutting)
    try:
        (a, a_model), (b, b_model) = _b_falls_behind(shards, connect, build, backward)

        # Execute: b's stale push is refused, the pull after it is cut, b joins the shard again
        cut["armed"] = True
        b.zero_grad()
        backward(b_model)
        b.step()

        # Assert: the pull was cut, and b still took up round 3 (its missed rounds counted)
        assert cut["done"] == 1
        assert b.session.caught_up == 2 and b.step_count == 3 and shards.status()[0]["version"] == 3

        # Execute: both loops run to the job's end (neither waits for a round the other will not push)
        _run_loops(backward, (a, a_model, a.step_count), (b, b_model, 1))

        # Assert: six rounds, one model
        assert a.step_count == b.step_count == STEPS and shards.status()[0]["version"] == STEPS
        final = shards.params()
        for values in (_values(a), _values(b)):
            for k in final:
                np.testing.assert_array_equal(values[k], final[k].reshape(-1), err_msg=k)
        a.close()
        b.close()
    finally:
        shards.stop()
