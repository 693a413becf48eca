"""The shards apply the script's own optimizer: the same result as the plain script, step for step.

Real TLS shards on 127.0.0.1, workers as threads of this process, real torch / paddle
training on both sides. The reference is the same loop with ``optimizer.step()`` and no
hybridfleet at all.
"""

from __future__ import annotations

import pytest

import script_optim_helpers as h


@pytest.fixture
def shards(tmp_path):
    started = []

    def start(framework: str, workers: int = 1, shards: int = 1, **ps):
        s = h.start_shards(tmp_path, h.job(framework, workers, shards, **ps))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# ------------------------------------------------------------------------------------------ torch
@pytest.mark.torch
@pytest.mark.parametrize("name", ["sgd_nesterov", "sgd_dampening", "adam", "adamw_amsgrad", "rmsprop", "adagrad"])
def test_torch_one_worker_bsp_matches_the_plain_script_for_50_steps(shards, name):
    # Prepare: the plain script's result, then the same script through two shards
    import hybridfleet.torch as hf
    import script_optim_torch as t

    ref = t.model()
    opt, sched = t.make(name, ref)
    t.train(ref, opt, sched, h.batches(0, h.TOTAL))
    cluster = shards("torch", shards=2)
    m = t.model()
    opt, sched = t.make(name, m)
    # Execute
    ps = hf.connect(m, opt, config=cluster.config(0))
    t.train(m, opt, sched, h.batches(0, h.TOTAL), ps=ps)
    ps.close()
    # Assert: the model, and the shards' own copy, match the plain script
    h.assert_close(t.values(m), t.values(ref))
    h.assert_close({k: v.reshape(t.values(m)[k].shape) for k, v in _by_param(cluster).items()}, t.values(ref))


def _by_param(cluster) -> dict:
    import numpy as np

    blocks = cluster.params()
    plan = cluster.servers[0].state.plan
    return {name: np.concatenate([blocks[b.key] for b in plan.blocks if b.param == name]) for name in plan.params}


# ----------------------------------------------------------------------------------------- paddle
@pytest.mark.paddle
@pytest.mark.parametrize("name", ["sgd", "momentum_nesterov", "adam", "adamw_decay_fun", "rmsprop", "adagrad"])
def test_paddle_one_worker_bsp_matches_the_plain_script_for_50_steps(shards, name):
    # Prepare: the plain script's result (its grad_clip included), then the same script through two shards
    import hybridfleet.paddle as hf
    import script_optim_paddle as p

    ref = p.model()
    opt, sched = p.make(name, ref)
    p.train(ref, opt, sched, h.batches(0, h.TOTAL))
    cluster = shards("paddle", shards=2)
    m = p.model()
    opt, sched = p.make(name, m)
    # Execute
    ps = hf.connect(m, opt, config=cluster.config(0))
    p.train(m, opt, sched, h.batches(0, h.TOTAL), ps=ps)
    ps.close()
    # Assert
    h.assert_close(p.values(m), p.values(ref))
