"""Every example model exports and verifies in both frameworks: the digits CNN (BatchNorm, dropout), the
Fashion ResNet (BatchNorm, per-image standardization) and the char transformer (int64 tokens, causal mask,
tied embedding), shrunk through their factories' arguments, each trained a few steps so BatchNorm's
running statistics are not the initial ones. Each artefact is checked on real rows the verification did
not see (Fashion-MNIST from Debian's files, stdlib bytes) against the framework model that was trained,
at a batch size the export never traced. Then `hfleet serve` answers the char transformer's int64
tokens to a real OIP client. (The digits MLP's exports are in test_serve_export.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt.run_model import ModelCheckpointer
from hybridfleet.serve.export import export_checkpoint
from hybridfleet.serve.factory import load_factory
from hybridfleet.serve.runtime import MANIFEST_NAME, load_runtime
from tests.needs import missing

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
SAMPLES = 32  # verification rows per export (the CLI's default is 256): keeps each case to seconds


@dataclass(frozen=True)
class Example:
    """One example model: its factory file and function stem, the shrinking arguments, and real held-out rows."""

    name: str
    factory_file: Path
    stem: str  # build_{stem}torch / build_{stem}paddle
    args: dict[str, str] = field(default_factory=dict)

    def factory(self, framework: str) -> str:
        return f"{self.factory_file}:build_{self.stem}{framework}"

    def held_out(self, rows: int) -> np.ndarray:
        """Real inputs past the ones `sample_inputs()` verifies on."""
        module = load_factory(self.factory("torch")).module
        if self.name == "charlm":
            context = int(self.args["context"])
            return module.sample_inputs(rows=40 + rows, context=context)[40:]
        return module.sample_inputs(rows=256 + rows)[256:]


DIGITS_CNN = Example("digits-cnn", EXAMPLES / "digits" / "digits_model.py", "cnn_")
FASHION = Example("fashion", EXAMPLES / "fashion" / "fashion_model.py", "", {"width": "4"})
CHARLM = Example("charlm", EXAMPLES / "charlm" / "charlm_model.py", "",
                 {"layers": "1", "d_model": "32", "context": "16", "heads": "2"})  # fmt: skip
EXAMPLES_BY_NAME = {e.name: e for e in (DIGITS_CNN, FASHION, CHARLM)}


def _need_data(example: Example) -> None:
    if example.name == "fashion" and not (FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        missing(f"Fashion-MNIST is not installed at {FASHION_DIR}: apt-get install dataset-fashion-mnist")


def _train_a_few_steps(example: Example, framework: str, steps: int = 3):
    """The example's model after ``steps`` SGD steps on real rows (BatchNorm statistics moved), in eval mode."""
    factory = load_factory(example.factory(framework))
    model = factory.build(**example.args)
    module = factory.module
    x = module.sample_inputs(**({"rows": 48, "context": int(example.args["context"]) + 1} if example.name == "charlm" else {"rows": 64}))
    rng = np.random.default_rng(0)
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        torch.manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.train()
        for _ in range(steps):
            if example.name == "charlm":
                tokens = torch.from_numpy(x)
                loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 256), tokens[:, 1:].reshape(-1))
            else:
                loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(rng.integers(0, 10, len(x))))
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        import paddle
        import paddle.nn.functional as F

        paddle.seed(0)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        model.train()
        for _ in range(steps):
            if example.name == "charlm":
                tokens = paddle.to_tensor(x)
                loss = F.cross_entropy(model(tokens[:, :-1]).reshape([-1, 256]), tokens[:, 1:].reshape([-1, 1]))
            else:
                loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(rng.integers(0, 10, (len(x), 1))))
            opt.clear_grad()
            loss.backward()
            opt.step()
    model.eval()
    return model


def _eager(model, framework: str, x: np.ndarray) -> np.ndarray:
    if framework == "torch":
        import torch

        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()
    import paddle

    with paddle.no_grad():
        return model(paddle.to_tensor(x)).numpy()


def _checkpoint(model, framework: str, root: Path) -> str:
    ckpt = ModelCheckpointer(str(root), framework, keep_last=1)
    ckpt.final(3, model, {})
    return ckpt.store.url


# (example, framework the model was trained in, format); onnx and torch-export take the torch factory
CASES = [(name, trained, fmt) for name in EXAMPLES_BY_NAME
         for trained, fmt in (("torch", "onnx"), ("torch", "torch-export"), ("paddle", "paddle-inference"),
                              ("paddle", "onnx"))]  # fmt: skip


def _marks(trained: str, fmt: str) -> list:
    frameworks = {trained, "paddle" if fmt == "paddle-inference" else "torch"}
    return [getattr(pytest.mark, f) for f in sorted(frameworks)]


@pytest.mark.parametrize("name,trained,fmt", [pytest.param(*c, marks=_marks(*c[1:]), id="-".join(c)) for c in CASES])
def test_every_example_model_exports_and_its_runtime_matches_the_trained_model(tmp_path, name, trained, fmt):
    # Prepare: the example model trained a few steps in ``trained``, saved as a run checkpoint
    example = EXAMPLES_BY_NAME[name]
    _need_data(example)
    model = _train_a_few_steps(example, trained)
    url = _checkpoint(model, trained, tmp_path / "run")
    export_framework = "paddle" if fmt == "paddle-inference" else "torch"
    # Execute: the exporter of the format, from the (possibly other framework's) factory
    manifest = export_checkpoint(url, fmt, tmp_path / "out", example.factory(export_framework), example.args,
                                 max_samples=SAMPLES)  # fmt: skip
    # Assert: verified on real inputs, int64 tokens declared as INT64, and held-out rows at a batch size never
    # traced give the trained model's outputs
    v = manifest["verification"]
    assert v["passed"] and v["provenance"] == "measured" and v["max_abs_diff"] <= 1e-5 and v["samples"] == SAMPLES
    saved = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert saved["verification"] == v and saved["factory_args"] == example.args
    declared = saved["inputs"][0]
    if name == "charlm":
        assert declared == {"name": "input", "datatype": "INT64", "shape": [-1, 16]}
    else:
        assert declared["datatype"] == "FP32" and declared["shape"][0] == -1
    x = example.held_out(5)
    got = load_runtime(tmp_path / "out").run({"input": x})["output"]
    # across frameworks the verification compares with the torch model holding the converted weights (1e-5); eager
    # paddle and eager torch float32 convolutions sum in different orders (measured up to 3e-5 on the ResNet's logits)
    np.testing.assert_allclose(got, _eager(model, trained, x), atol=1e-5 if trained == export_framework else 1e-4, rtol=0)


@pytest.mark.torch
def test_charlm_export_refuses_float_sample_rows_for_its_token_input(tmp_path):
    # Prepare: a .npy of float rows for a model whose input is int64 tokens
    from hybridfleet.errors import UsageError

    model = load_factory(CHARLM.factory("torch")).build(**CHARLM.args)
    url = _checkpoint(model, "torch", tmp_path / "run")
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([["a"] * 16], dtype="<U1"))
    # Execute / Assert: a clear refusal, nothing written
    with pytest.raises(UsageError, match="sample inputs must be floating-point or integer numbers"):
        export_checkpoint(url, "onnx", tmp_path / "out", CHARLM.factory("torch"), CHARLM.args, sample=str(bad))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


# -- hfleet serve answers the char transformer's int64 tokens over OIP --------------------------------------------


@pytest.fixture
def served_charlm(tmp_path):
    """(registry, token, live server, trained torch model) serving charlm@prod (the ONNX export)."""
    pytest.importorskip("tritonclient.http", reason="the OIP client of these tests: pip install 'tritonclient[http]'")
    from hybridfleet.registry import Registry
    from hybridfleet.serve.export import export_version
    from hybridfleet.serve.run import build
    from tests.serve_fixtures import LiveServer

    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    model = _train_a_few_steps(CHARLM, "torch")
    info = reg.register("charlm", _checkpoint(model, "torch", tmp_path / "run"))
    export_version(reg, f"charlm@{info.version}", "onnx", tmp_path / "export", CHARLM.factory("torch"), CHARLM.args)
    reg.move_alias("charlm", "prod", info.version)
    token = reg.add_principal("svc", "service")
    reg.grant("svc", "reader", "default/charlm")
    app, rollout = build(reg, "charlm@prod", cache_dir=str(tmp_path / "cache"), poll_s=0.1)
    with LiveServer(app) as server:
        yield reg, token, server, model
    rollout.stop()


@pytest.mark.torch
def test_serve_answers_int64_tokens_with_the_trained_models_logits(served_charlm):
    import tritonclient.http as oip

    reg, token, server, model = served_charlm
    client = oip.InferenceServerClient(server.url)
    headers = {"Authorization": f"Bearer {token}"}
    meta = client.get_model_metadata("charlm", headers=headers)
    assert meta["inputs"] == [{"name": "input", "datatype": "INT64", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 16, 256]}]
    x = CHARLM.held_out(3)
    for binary in (True, False):  # the binary tensor extension and JSON integers
        tensor = oip.InferInput("input", list(x.shape), "INT64")
        tensor.set_data_from_numpy(x, binary_data=binary)
        result = client.infer("charlm", [tensor], outputs=[oip.InferRequestedOutput("output", binary_data=binary)],
                              headers=dict(headers))  # a copy: the client adds its binary header length to the dict
        assert result.get_response()["model_version"] == "1"
        np.testing.assert_allclose(result.as_numpy("output"), _eager(model, "torch", x), atol=1e-5, rtol=0)


@pytest.mark.torch
@pytest.mark.parametrize("data,message", [
    ([1.5] * 16, "the model takes int64 and the data holds values that are not integers"),
    ([True] * 16, "the model takes int64 and the data holds values that are not integers"),
    ([2**64] * 16, "the model takes int64 and the data holds values that are not integers"),
])  # fmt: skip
def test_serve_refuses_token_data_a_cast_would_change_and_counts_it(served_charlm, data, message):
    import httpx

    reg, token, server, _ = served_charlm
    body = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "INT64", "data": data}]}
    with httpx.Client(base_url=f"http://{server.url}", headers={"Authorization": f"Bearer {token}"}) as c:
        before = c.get("/metrics").text
        r = c.post("/v2/models/charlm/infer", json=body)
        after = c.get("/metrics").text
    assert r.status_code == 400 and message in r.json()["error"]
    bad = 'hybridfleet_serve_errors_total{kind="bad_request",model="charlm",version=""}'
    assert _count(after, bad) == _count(before, bad) + 1
    assert _count(after, 'hybridfleet_serve_requests_total{code="200",model="charlm",version="1"}') == \
        _count(before, 'hybridfleet_serve_requests_total{code="200",model="charlm",version="1"}') == 0


def _count(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series):
            return float(line.split()[-1])
    return 0.0
