"""Parameters without a gradient under site aggregation: not stepped, as with direct pushes.

Two workers of one site train an MLP whose first layer is frozen, against a real TLS shard on
127.0.0.1 whose optimizer (SGD with momentum and weight decay) would move any key it steps.
With ``aggregate: true`` the leader reduces with its follower over the real site hub (TLS,
the follower's own token); without it each worker pushes alone. Workers run as threads of
this process, real torch / paddle training.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from hybridfleet.ps.server.serve import server_security, start_shard
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.session import WorkerConfig
from hybridfleet.ps.worker.site_security import HUB_CERT_ENV, HUB_KEY_ENV, VERIFY_KEY_ENV
from hybridfleet.security.certs import hub_certificate_paths, issue_hub_certificate, make_dev_pki
from hybridfleet.security.credentials import issue_site_credentials
from hybridfleet.security.tokens import VERIFY_KEY, TokenIssuer, generate_signing_key
from hybridfleet.spec import parse_spec
from script_optim_helpers import run_workers

STEPS = 6
FRAMEWORKS = [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    issue_hub_certificate(make_dev_pki(d, clients=["a"]), "a")
    generate_signing_key(d)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Torch:
    def build(self):
        import torch

        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        m[0].requires_grad_(False)
        return m

    def loss_backward(self, m, x, y):
        import torch

        torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y)).backward()

    def values(self, m) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in m.state_dict().items()}


class Paddle:
    def build(self):
        import paddle

        paddle.seed(0)
        m = paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 3))
        for p in m[0].parameters():
            p.stop_gradient = True
        return m

    def loss_backward(self, m, x, y):
        import paddle

        paddle.nn.functional.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()

    def values(self, m) -> dict[str, np.ndarray]:
        return {n: p.numpy().copy() for n, p in m.state_dict().items()}


def _train(framework: str, certs, aggregate: bool, monkeypatch) -> tuple[list[dict], dict]:
    """Both workers' final values and the model's initial values."""
    import importlib

    hf, fw = importlib.import_module(f"hybridfleet.{framework}"), {"torch": Torch, "paddle": Paddle}[framework]()
    spec = parse_spec({"name": "nograd", "framework": framework, "entrypoint": "train.py",
                       "sites": {"a": {"workers": 2, "aggregate": aggregate}},
                       "ps": {"shards": 1, "sync": "bsp", "block_size_bytes": 1024, "heartbeat_interval_s": 0.2,
                              "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}}})
    server = start_shard(spec, 0, "127.0.0.1", 0, server_security(spec, certs), 2)
    pair = hub_certificate_paths(certs, "a")
    for name, value in {HUB_CERT_ENV: pair.cert, HUB_KEY_ENV: pair.key, "HFLEET_CA_CERT": certs / "ca.pem",
                        VERIFY_KEY_ENV: certs / VERIFY_KEY}.items():
        monkeypatch.setenv(name, str(value))
    tokens = issue_site_credentials(spec, "a", TokenIssuer.from_dir(certs)).workers
    hub = f"127.0.0.1:{_free_port()}" if aggregate else None
    lock = threading.Lock()  # one build or forward/backward at a time: the frameworks' state is per process

    def worker(rank: int) -> dict:
        sec = ClientSecurity.from_files(str(certs / "ca.pem"), token=tokens[f"a-{rank}"].token)
        cfg = WorkerConfig(job=spec, site="a", rank=rank, site_rank=rank, servers=[server.address], security=sec,
                           site_hub=hub)
        with lock:  # seeding and building draw from the framework's global generator
            m = fw.build()
        ps = hf.connect(m, config=cfg)
        rng = np.random.default_rng(rank)
        for _ in range(STEPS):
            x = rng.standard_normal((4, 6)).astype(np.float32)
            y = rng.integers(0, 3, 4).astype(np.int64)
            ps.zero_grad()
            with lock:
                fw.loss_backward(m, x, y)
            ps.step()
        ps.close()
        return fw.values(m)

    try:
        return run_workers(worker, 2), fw.values(fw.build())
    finally:
        server.stop(0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_frozen_layer_keeps_its_values_under_site_aggregation_and_the_rest_trains_as_direct_pushes(
        certs, monkeypatch, framework):
    # Prepare / Execute: the same two workers, pushing alone, then reducing at their site first
    direct, initial = _train(framework, certs, aggregate=False, monkeypatch=monkeypatch)
    aggregated, _ = _train(framework, certs, aggregate=True, monkeypatch=monkeypatch)
    # Assert: the frozen layer bit for bit on every worker; the trained layer as with direct pushes
    frozen = [n for n in initial if n.startswith("0.")]
    trained = [n for n in initial if n.startswith("2.")]
    assert frozen and trained
    for values in (*direct, *aggregated):
        for n in frozen:
            assert np.array_equal(values[n], initial[n]), n
    for n in trained:
        assert not np.array_equal(aggregated[0][n], initial[n]), n
        assert np.array_equal(aggregated[0][n], aggregated[1][n]), n
        np.testing.assert_allclose(aggregated[0][n], direct[0][n], rtol=1e-6, atol=1e-7, err_msg=n)
