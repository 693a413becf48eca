"""One job, two frameworks: a paddle site and a torch site train one model through real TLS shards."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.errors import SpecError
from hybridfleet.ps.server.serve import server_security, start_shard
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.session import WorkerConfig
from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
from hybridfleet.spec import load_spec, parse_spec

pytestmark = pytest.mark.torch  # a job with torch and paddle workers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "digits"))

WIDTHS = [64, 32, 10]


def mixed_spec(**ps):
    return parse_spec({
        "name": "mixed", "framework": "torch", "entrypoint": "train_torch.py",
        "sites": {"cloud": {"workers": 1, "data": "digits:site-b"},
                  "hospital": {"workers": 1, "data": "digits:site-a", "framework": "paddle",
                               "entrypoint": "train_paddle.py"}},
        "ps": {"shards": 2, "sync": "bsp", "optimizer": {"name": "adam", "lr": 0.003}, "block_size_bytes": 1024,
               "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, **ps}})


@pytest.fixture
def shards(tmp_path):
    spec = mixed_spec()
    certs = tmp_path / "certs"
    make_dev_pki(certs)
    generate_signing_key(certs)
    security = server_security(spec, certs)
    servers = [start_shard(spec, i, "127.0.0.1", 0, security, 2) for i in range(spec.ps.shards)]
    issuer = TokenIssuer.from_dir(certs)

    def config(site: str, rank: int) -> WorkerConfig:
        token = issuer.issue(spec.name, site, "worker", 600, worker=f"{site}-0")  # the worker id of site rank 0
        sec = ClientSecurity.from_files(str(load_pki(certs).ca_cert), token=token)
        return WorkerConfig(job=spec, site=site, rank=rank, servers=[s.address for s in servers], security=sec)

    yield config, servers
    for s in servers:
        s.stop(0)


def torch_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTHS[1], WIDTHS[2]))


def paddle_model(extra=None):
    import paddle

    paddle.seed(1)  # other initial values than torch's: the job's values replace them on join
    layers = [paddle.nn.Linear(WIDTHS[0], WIDTHS[1]), paddle.nn.ReLU(), paddle.nn.Linear(WIDTHS[1], WIDTHS[2])]
    return paddle.nn.Sequential(*layers, *([extra] if extra is not None else []))


def test_torch_and_paddle_workers_hold_equivalent_parameters_after_bsp_steps(shards):
    # Prepare: a torch worker (rank 0, initialises the job) and a paddle worker, each on its own site's rows
    import paddle
    import torch
    from digits_data import load_site, load_test

    import hybridfleet.paddle as hf_paddle
    import hybridfleet.torch as hf_torch

    config, _ = shards
    x_test, _ = load_test()
    handles: dict = {}
    models = {"cloud": torch_model(), "hospital": paddle_model()}
    errors: list[BaseException] = []

    def train(site: str, rank: int) -> None:
        try:
            x, y = load_site(f"digits:site-{'b' if site == 'cloud' else 'a'}")
            rng = np.random.default_rng(rank)
            if site == "cloud":
                ps = handles[site] = hf_torch.connect(models[site], config=config(site, rank))
            else:
                ps = handles[site] = hf_paddle.connect(models[site], config=config(site, rank))
            for _ in range(10):
                batch = rng.integers(0, len(x), 32)
                if site == "cloud":
                    loss = torch.nn.functional.cross_entropy(models[site](torch.from_numpy(x[batch])),
                                                             torch.from_numpy(y[batch]))
                else:
                    loss = paddle.nn.functional.cross_entropy(models[site](paddle.to_tensor(x[batch])),
                                                              paddle.to_tensor(y[batch]))
                ps.zero_grad()
                loss.backward()
                ps.step()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            errors.append(err)

    threads = [threading.Thread(target=train, args=(site, rank)) for rank, site in enumerate(["cloud", "hospital"])]
    # Execute
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # Assert
    assert not errors, errors
    assert handles["cloud"].session.params_digest() == handles["hospital"].session.params_digest()
    assert handles["hospital"].layout is not None and handles["cloud"].layout is None
    with torch.no_grad():
        out_torch = models["cloud"](torch.from_numpy(x_test)).numpy()
    with paddle.no_grad():
        out_paddle = models["hospital"](paddle.to_tensor(x_test)).numpy()
    np.testing.assert_allclose(out_paddle, out_torch, rtol=0, atol=1e-5)
    assert handles["cloud"].step_count == handles["hospital"].step_count == 10
    for h in handles.values():
        h.close()


def test_unmappable_paddle_layer_is_refused_before_joining_naming_it(shards):
    import paddle

    import hybridfleet.paddle as hf_paddle

    config, servers = shards
    model = paddle_model(extra=paddle.nn.LSTM(10, 4))
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    with pytest.raises(SpecError, match=r"sites.hospital.framework: this paddle model cannot join a torch job: "
                                        r"tensor '3\.\w+' has an unknown layout .*layer kind unrecorded"):
        hf_paddle.connect(model, config=config("hospital", 1))
    assert all(np.array_equal(before[k], v.numpy()) for k, v in model.state_dict().items())
    assert all(not s.state.members and s.state.plan is None for s in servers)  # nothing joined


def test_site_declaring_another_framework_than_its_script_is_refused(shards):
    import hybridfleet.torch as hf_torch

    config, servers = shards
    with pytest.raises(SpecError, match="sites.hospital.framework: the site declares paddle, this script trains "
                                        "with torch"):
        hf_torch.connect(torch_model(), config=config("hospital", 1))
    assert all(not s.state.members for s in servers)


def test_script_of_another_framework_than_the_jobs_is_refused_at_connect(shards):
    import hybridfleet.paddle as hf_paddle

    config, servers = shards
    model = paddle_model()
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    with pytest.raises(SpecError, match="framework: site cloud trains with the job's framework, torch; this script "
                                        "trains with paddle"):
        hf_paddle.connect(model, config=config("cloud", 0))
    assert all(np.array_equal(before[k], v.numpy()) for k, v in model.state_dict().items())
    assert all(not s.state.members for s in servers)


def test_site_of_another_framework_without_its_own_entrypoint_is_a_spec_error():
    with pytest.raises(SpecError, match="sites.hospital.entrypoint: site hospital trains with paddle, the job's "
                                        "entrypoint is for torch"):
        parse_spec({"name": "x", "framework": "torch", "entrypoint": "t.py",
                    "sites": {"hospital": {"framework": "paddle"}}})


@pytest.mark.slow
def test_digits_mixed_job_matches_a_single_framework_run(tmp_path):
    # Prepare: the example (cloud torch, hospital paddle) and the same job with torch at both sites
    from hybridfleet.launch.psjob import run_ps_job

    data = yaml.safe_load((REPO / "examples/digits-mixed.yaml").read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["sites"]["hospital"]["entrypoint"] = str(REPO / data["sites"]["hospital"]["entrypoint"])
    for site in data["sites"].values():  # packed site datasets ship in the repository
        site["data"] = str(REPO / site["data"])
    data["train"]["site_baselines"] = False
    single = json.loads(json.dumps(data))
    del single["sites"]["hospital"]["framework"], single["sites"]["hospital"]["entrypoint"]
    summaries = {}
    for name, job_data in (("mixed", data), ("torch", single)):
        job = tmp_path / f"{name}.yaml"
        job.write_text(yaml.safe_dump(job_data))
        # Execute
        summaries[name] = run_ps_job(load_spec(job), job, echo=False, show_progress=False,
                                     run_root=tmp_path / f"runs-{name}")
    # Assert
    mixed, torch_only = summaries["mixed"], summaries["torch"]
    assert mixed["status"] == torch_only["status"] == "completed"
    assert abs(mixed["test_accuracy"] - torch_only["test_accuracy"]) <= 0.01
    assert mixed["test_accuracy"] >= 0.95
    finals = [json.loads(line) for line in (Path(mixed["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    digests = {m["process"]: m["params_sha256"] for m in finals if m.get("final")}
    assert set(digests) == {"worker-cloud-0", "worker-cloud-1", "worker-hospital-0", "worker-hospital-1"}
    # paddle and torch workers end with bit-identical canonical parameters (a worker that fell out of the
    # quorum on a loaded machine may miss the last round, so compare each paddle worker with the torch ones)
    torch_digests = {digests["worker-cloud-0"], digests["worker-cloud-1"]}
    assert digests["worker-hospital-0"] in torch_digests and digests["worker-hospital-1"] in torch_digests
