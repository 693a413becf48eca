"""`hfleet serve` answered by a real Open Inference Protocol client (tritonclient's HTTP client): metadata,
inference equal to the exported model's, the rollout split equal to the registry's own resolve, a
rollback mid-traffic with no failed request, tokens, TLS, bad input and metrics."""

from __future__ import annotations

import ssl
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("tritonclient.http", reason="the OIP client of these tests: pip install 'tritonclient[http]'")
import tritonclient.http as oip  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from hybridfleet.registry.aliases import bucket  # noqa: E402
from tests.serve_fixtures import LiveServer, exported_registry, reader_token  # noqa: E402
from tests.serve_models import load_test  # noqa: E402

pytest_plugins = ["tests.serve_fixtures"]
pytestmark = pytest.mark.torch  # the served versions are torch models exported to ONNX (one paddle test below)


def _client(server, token: str | None) -> oip.InferenceServerClient:
    return oip.InferenceServerClient(server.url, concurrency=4)


def _headers(token: str | None, key: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if key is not None:
        headers["X-Routing-Key"] = key
    return headers


def _infer(client, x: np.ndarray, token: str, key: str | None = None, binary: bool = True):
    tensor = oip.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    outputs = [oip.InferRequestedOutput("output", binary_data=binary)]
    return client.infer("digits", [tensor], outputs=outputs, headers=_headers(token, key))


def _onnx_logits(reg, version: int, x: np.ndarray, tmp_path) -> np.ndarray:
    import onnxruntime as ort

    from hybridfleet.serve.export import fetch_export

    path, _ = fetch_export(reg, f"digits@{version}", "onnx", tmp_path / "check-cache")
    return ort.InferenceSession(str(path / "digits/1/model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def test_metadata_and_inference_match_the_exported_model(served, tmp_path):
    reg, token, server, _ = served
    client = _client(server, token)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_model_metadata("digits", headers=_headers(token))
    assert meta["platform"] == "onnx_onnxv1" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert client.is_model_ready("digits", headers=_headers(token))
    x = load_test()[0][:32]
    for binary in (True, False):  # the binary tensor extension and plain JSON tensors
        result = _infer(client, x, token, binary=binary)
        assert result.get_response()["model_version"] == "1"
        np.testing.assert_allclose(result.as_numpy("output"), _onnx_logits(reg, 1, x, tmp_path), atol=1e-6, rtol=0)


def test_a_keyed_request_goes_where_the_registry_resolves_its_key(served):
    # Prepare: a canary at 30 %
    reg, token, server, rollout = served
    reg.rollout("digits", "prod", canary=2, weight=30)
    assert rollout.refresh() or rollout.state.canary == 2
    client = _client(server, token)
    x = load_test()[0][:1]
    # Execute: 300 keys
    got = {f"user-{i}": _infer(client, x, token, key=f"user-{i}").get_response()["model_version"] for i in range(200)}
    # Assert: each key answered by the version the registry's resolve names for it, and again on a repeat
    assert got == {k: str(reg.resolve("digits@prod", key=k)["version"]) for k in got}
    assert 25 <= Counter(got.values())["2"] <= 95  # 30 % of 200 keys, well inside the binomial spread
    assert all(_infer(client, x, token, key=k).get_response()["model_version"] == v for k, v in list(got.items())[:20])


def test_unkeyed_requests_split_by_the_weight_and_name_the_answering_version(served, tmp_path):
    reg, token, server, rollout = served
    reg.rollout("digits", "prod", canary=2, weight=25)
    rollout.refresh()
    client = _client(server, token)
    x = load_test()[0][:4]
    versions = Counter()
    for _ in range(400):
        versions[int(_infer(client, x, token).get_response()["model_version"])] += 1
    assert abs(versions[2] / 400 - 0.25) < 5 * (0.25 * 0.75 / 400) ** 0.5  # five standard deviations: fails ~1 run in 10^6
    canary_key = next(k for k in map(str, range(10_000)) if bucket("default/digits", "prod", k) < 2500)
    result = _infer(client, x, token, key=canary_key)
    assert result.get_response()["model_version"] == "2"
    np.testing.assert_allclose(result.as_numpy("output"), _onnx_logits(reg, 2, x, tmp_path), atol=1e-6, rtol=0)


def test_rollback_mid_traffic_fails_no_request_and_moves_traffic_back(served, capsys):
    from hybridfleet.cli.app import main as cli_main

    reg, token, server, rollout = served
    reg.rollout("digits", "prod", canary=2, weight=50)
    rollout.refresh()
    x = load_test()[0][:8]
    answers: list[tuple[float, str]] = []
    failures: list[str] = []
    rolled_back_at: list[float] = []

    def client_loop() -> None:
        client = oip.InferenceServerClient(server.url)
        for _ in range(120):
            try:
                answers.append((time.monotonic(), _infer(client, x, token).get_response()["model_version"]))
            except InferenceServerException as err:
                failures.append(str(err))

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for t in threads:
        t.start()
    while len(answers) < 100:
        time.sleep(0.01)
    with pytest.raises(SystemExit) as done:  # the release manager's command, mid-traffic
        cli_main(["registry", "rollout", "digits", "--alias", "prod", "--rollback", "-r", reg.db_url])
        sys.exit(0)
    assert done.value.code == 0
    rolled_back_at.append(time.monotonic())
    for t in threads:
        t.join()
    assert failures == [] and len(answers) == 480
    before = Counter(v for at, v in answers if at < rolled_back_at[0])
    settled = [v for at, v in answers if at > rolled_back_at[0] + 1.0]  # poll_s 0.1: one second is ten refreshes
    assert before["2"] > 0 and before["1"] > 0
    assert settled and set(settled) == {"1"}


def test_requests_without_a_valid_reader_token_are_refused_and_nothing_runs(served):
    import httpx

    reg, token, server, _ = served
    reg.add_principal("outsider", "user")
    base = f"http://{server.url}"
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}
    before = httpx.get(base + "/metrics").text.count('code="200"')
    cases = {None: (401, "missing token"), "Bearer \u00a0": (401, "malformed bearer token"),
             "Bearer hfr_wrong": (401, "not valid"), "Bearer " + token + " x": (401, "malformed")}  # fmt: skip
    for header, (status, text) in cases.items():
        r = httpx.post(base + "/v2/models/digits/infer", json=body, headers={"Authorization": header.encode()} if header else {})
        assert r.status_code == status and text in r.json()["error"], (header, r.text)
    outsider = reg.add_principal("outsider2", "user")
    r = httpx.post(base + "/v2/models/digits/infer", json=body, headers={"Authorization": f"Bearer {outsider}"})
    assert r.status_code == 403 and "needs role 'reader' on default/digits" in r.json()["error"]
    assert httpx.get(base + "/metrics").text.count('code="200"') == before  # nothing was answered


@pytest.mark.parametrize("body,status,text", [
    (b"{not json", 400, "not JSON"),
    (b'{"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": []}]}', 400, "does not fit the model's [-1, 64]"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP64", "data": []}]}', 400, "the model takes FP32"),
    (b'{"inputs": [{"name": "input", "shape": [2, 64], "datatype": "FP32", "data": [1.0]}]}', 400, "1 values for shape [2, 64]"),
    (b'{"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": []}]}', 400, "unknown input 'x'"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "parameters": {"binary_data_size": 256}}]}', 400, "binary bytes announced"),
    (b'{"inputs": [{"name": ["input"], "shape": [1, 64], "datatype": "FP32", "data": []}]}', 400, "unknown input ['input']"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "parameters": [1], "data": []}]}', 400, "input 'input': 'parameters' must be an object"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [' + b",".join([b"0"] * 64) + b']}], "outputs": [{"name": ["output"]}]}', 400, "unknown output ['output']"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [' + b",".join([b"0"] * 64) + b']}], "outputs": [{"name": "output", "parameters": 1}]}', 400, "output 'output': 'parameters' must be an object"),
    (b'{"inputs": [{"name": "input", "shape": [true, 64], "datatype": "FP32", "data": []}]}', 400, "shape must be a list of non-negative integers"),
    (b'{"inputs": [{"name": "input", "shape": [0, 64], "datatype": "FP32", "data": []}]}', 400, "the batch is empty"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "request body is not JSON: nested too deeply"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [1e400' + b",0" * 63 + b']}]}', 400, "data holds NaN or infinity"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [NaN' + b",0" * 63 + b']}]}', 400, "data holds NaN or infinity"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [true' + b",0" * 63 + b']}]}', 400, "the data holds JSON booleans"),
    (b'{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ["0.5"' + b",0" * 63 + b']}]}', 400, "the model takes float32 (numbers) and the data holds strings"),
])  # fmt: skip
def test_bad_infer_requests_get_a_400_with_the_reason(served, body, status, text):
    import httpx

    _, token, server, _ = served
    r = httpx.post(f"http://{server.url}/v2/models/digits/infer", content=body, headers=_headers(token))
    assert r.status_code == status and text in r.json()["error"]
    r = httpx.post(f"http://{server.url}/v2/models/other/infer", content=body, headers=_headers(token))
    assert r.status_code == 404 and "not served here" in r.json()["error"]


def test_an_oversized_or_non_post_infer_request_is_refused_before_anything_runs(served, monkeypatch):
    # Prepare: a small body limit, so a test body can pass it (chunked: no Content-Length to refuse it up front)
    import httpx

    from hybridfleet.serve import infer

    _, token, server, _ = served
    monkeypatch.setattr(infer, "MAX_BODY_BYTES", 1000)
    base = f"http://{server.url}"
    before = httpx.get(base + "/metrics").text.count('code="200"')
    # Execute
    declared = httpx.post(base + "/v2/models/digits/infer", content=b"x" * 2000, headers=_headers(token))
    streamed = httpx.post(base + "/v2/models/digits/infer", content=iter([b"x" * 600, b"x" * 600]), headers=_headers(token))
    got = httpx.get(base + "/v2/models/digits/versions/1/infer", headers=_headers(token))
    # Assert: each refused with its reason as JSON, and no inference answered
    assert declared.status_code == 400 and "request body of 2000 bytes is over the limit of 1000" in declared.json()["error"]
    assert streamed.status_code == 400 and "more than 1000 bytes is over the limit" in streamed.json()["error"]
    assert got.status_code == 405 and got.json() == {"error": "the infer endpoint takes POST"}
    assert httpx.get(base + "/metrics").text.count('code="200"') == before


def test_metrics_count_requests_and_latency_by_version(served):
    import httpx

    _, token, server, _ = served
    client = _client(server, token)
    for _ in range(5):
        _infer(client, load_test()[0][:2], token)
    text = httpx.get(f"http://{server.url}/metrics").text
    assert 'hybridfleet_serve_requests_total{code="200",model="digits",version="1"} 5.0' in text
    assert 'hybridfleet_serve_request_duration_seconds_count{model="digits",version="1"} 5.0' in text


def test_hfleet_serve_command_over_tls_with_a_token(exported, tmp_path):
    # Prepare: a real PKI and the command as a user runs it
    import httpx

    from hybridfleet.security.certs import make_dev_pki

    reg = exported
    token = reader_token(reg)
    make_dev_pki(tmp_path / "certs", hosts=["127.0.0.1"])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "serve", "digits@prod", "-r", reg.db_url, "--port", str(port),
                             "--certs", str(tmp_path / "certs"), "--cache-dir", str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        client = httpx.Client(base_url=f"https://127.0.0.1:{port}",
                              verify=ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.pem")))
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.get("/v2/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode() if proc.poll() is not None else "timeout"
            time.sleep(0.2)
        body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": load_test()[0][0].tolist()}]}
        r = client.post("/v2/models/digits/infer", json=body, headers=_headers(token))
        assert r.status_code == 200 and r.json()["model_version"] == "1" and r.json()["outputs"][0]["shape"] == [1, 10]
        assert client.post("/v2/models/digits/infer", json=body).status_code == 401
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=5)  # no plaintext on the TLS port
        client.close()
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("hfleet serve did not stop on SIGTERM: " + proc.communicate()[0].decode()[-2000:]) from None
    assert code in (0, -15), proc.stdout.read().decode()[-2000:]


def test_serve_refuses_to_start_without_tls_or_an_export(exported, tmp_path):
    from hybridfleet.errors import UsageError
    from hybridfleet.serve.run import serve

    reg = exported
    with pytest.raises(UsageError, match="--certs DIR is required"):
        serve(reg, "digits@prod", "127.0.0.1", 0, None)
    from tests.serve_models import trained_digits

    reg.register("digits", trained_digits(tmp_path / "run-3", "torch", seed=3))
    reg.move_alias("digits", "staging", 3)
    with pytest.raises(UsageError, match="has no verified export"):
        serve(reg, "digits@staging", "127.0.0.1", 0, None, insecure_plaintext=True)


@pytest.mark.paddle
def test_a_paddle_inference_artefact_is_served_and_matches_its_predictor(tmp_path):
    from hybridfleet.serve.export import fetch_export
    from hybridfleet.serve.run import build
    from hybridfleet.serve.runtime import load_runtime

    reg = exported_registry(tmp_path, framework="paddle", fmt="paddle-inference")
    token = reader_token(reg)
    app, rollout = build(reg, "digits@prod", cache_dir=str(tmp_path / "cache"), poll_s=1.0)
    x = load_test()[0][:16]
    try:
        with LiveServer(app) as server:
            client = _client(server, token)
            assert client.get_model_metadata("digits", headers=_headers(token))["platform"] == "paddle_inference"
            got = _infer(client, x, token).as_numpy("output")
    finally:
        rollout.stop()
    path, _ = fetch_export(reg, "digits@1", "paddle-inference", tmp_path / "check")
    np.testing.assert_allclose(got, load_runtime(path).run({"input": x})["output"], atol=1e-6, rtol=0)
