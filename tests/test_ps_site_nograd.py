"""Parameters without a gradient under site aggregation and secure aggregation: not stepped,
as with direct pushes.

Three workers (two at site ``a``, one at ``b``) train an MLP whose first layer is frozen,
against a real TLS shard on 127.0.0.1 whose optimizer (SGD with momentum and weight decay)
would move any key it steps. With ``aggregate: true`` site ``a``'s leader reduces with its
follower over the real site hub (TLS, the follower's own token); with secure aggregation
every pusher masks its update; without either each worker pushes alone. Workers run as
threads of this process, real torch / paddle training.
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
    issue_hub_certificate(make_dev_pki(d, clients=["a", "b"]), "a")
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


WORKERS = [("a", 0), ("a", 1), ("b", 0)]  # (site, site rank); the global rank is the index


def _train(framework: str, certs, monkeypatch, aggregate: bool = False, secure: bool = False) -> tuple[list[dict], dict]:
    """Every worker's final values and the model's initial values."""
    import importlib

    hf, fw = importlib.import_module(f"hybridfleet.{framework}"), {"torch": Torch, "paddle": Paddle}[framework]()
    spec = parse_spec({"name": "nograd", "framework": framework, "entrypoint": "train.py",
                       "sites": {"a": {"workers": 2, "aggregate": aggregate}, "b": {"workers": 1}},
                       "ps": {"shards": 1, "sync": "bsp", "block_size_bytes": 1024, "heartbeat_interval_s": 0.2,
                              "secure_aggregation": secure or None,
                              "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}}})
    server = start_shard(spec, 0, "127.0.0.1", 0, server_security(spec, certs), len(WORKERS))
    pair = hub_certificate_paths(certs, "a")
    for name, value in {HUB_CERT_ENV: pair.cert, HUB_KEY_ENV: pair.key, "HFLEET_CA_CERT": certs / "ca.pem",
                        VERIFY_KEY_ENV: certs / VERIFY_KEY}.items():
        monkeypatch.setenv(name, str(value))
    issuer = TokenIssuer.from_dir(certs)
    tokens = {**issue_site_credentials(spec, "a", issuer).workers, **issue_site_credentials(spec, "b", issuer).workers}
    hub = f"127.0.0.1:{_free_port()}" if aggregate else None
    lock = threading.Lock()  # one build or forward/backward at a time: the frameworks' state is per process

    def worker(rank: int) -> dict:
        site, site_rank = WORKERS[rank]
        sec = ClientSecurity.from_files(str(certs / "ca.pem"), token=tokens[f"{site}-{site_rank}"].token)
        cfg = WorkerConfig(job=spec, site=site, rank=rank, site_rank=site_rank, servers=[server.address],
                           security=sec, site_hub=hub if site == "a" else None)
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
        return run_workers(worker, len(WORKERS)), fw.values(fw.build())
    finally:
        server.stop(0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("aggregate, secure", [(True, False), (False, True), (True, True)],
                         ids=["site-aggregation", "secure-aggregation", "both"])
def test_a_frozen_layer_keeps_its_values_and_the_rest_trains_as_with_direct_pushes(
        certs, monkeypatch, framework, aggregate, secure):
    # Prepare / Execute: the same workers pushing alone, then reducing at their site first and/or masked
    direct, initial = _train(framework, certs, monkeypatch)
    got, _ = _train(framework, certs, monkeypatch, aggregate=aggregate, secure=secure)
    # Assert: the frozen layer bit for bit on every worker; the trained layer as with direct pushes
    # (within the ring's quantisation under secure aggregation)
    frozen = [n for n in initial if n.startswith("0.")]
    trained = [n for n in initial if n.startswith("2.")]
    assert frozen and trained
    for values in (*direct, *got):
        for n in frozen:
            assert np.array_equal(values[n], initial[n]), n
    for n in trained:
        assert not np.array_equal(got[0][n], initial[n]), n
        assert all(np.array_equal(got[0][n], other[n]) for other in got[1:]), n
        np.testing.assert_allclose(got[0][n], direct[0][n], rtol=1e-5 if secure else 1e-6, atol=1e-6, err_msg=n)
