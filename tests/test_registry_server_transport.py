"""The registry server as a network service: body and header limits before parsing and before
authentication (a served subprocess's RSS measured), deadlines for slow clients, TLS from the
project's PKI with optional mutual TLS, and no plaintext off loopback (server and client side)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from hybridfleet.errors import EXIT_CODES, AuthError, RegistryError
from hybridfleet.registry import Registry
from hybridfleet.registry.client import RemoteRegistry
from hybridfleet.registry.http_limits import DeadlineH11Protocol
from hybridfleet.registry.server import create_app, uvicorn_config
from tests.test_registry_server import cli

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
HTTP = httpx.Client(timeout=120)  # generous: the machine may be busy; no figure is timed here


def _free_port() -> int:
    from hybridfleet.launch.preflight import free_port

    return free_port("127.0.0.1")


class Served:
    """uvicorn with the registry's own configuration (limits, deadlines, TLS) in a thread."""

    def __init__(self, registry: Registry, header_timeout_s: float | None = None, body_timeout_s: float | None = None, **tls):
        import uvicorn

        self.port = _free_port()
        config = uvicorn_config(create_app(registry), "127.0.0.1", self.port, **tls)
        if header_timeout_s is not None:
            config.http = type("QuickHead", (DeadlineH11Protocol,), {"header_timeout_s": header_timeout_s})
        if body_timeout_s is not None:
            config.app.body_timeout_s = body_timeout_s
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.scheme = "https" if tls.get("certs") else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "registry server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def owner(tmp_path) -> Registry:
    return Registry(f"sqlite:///{tmp_path / 'reg.db'}", store=str(tmp_path / "artifacts"))


def _send_big(port: int, size: int, chunked: bool) -> tuple[int, str]:
    """POST ``size`` bytes without a token; (status, body) of the answer, however early it comes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("POST", "/api/v1/principals")
    conn.putheader("Content-Type", "application/json")
    if chunked:
        conn.putheader("Transfer-Encoding", "chunked")
    else:
        conn.putheader("Content-Length", str(size))
    conn.endheaders()
    chunk = b"[" + b"1," * (MiB // 2 - 1) + b"1"
    try:
        for _ in range(size // len(chunk)):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the body was sent: what a cap should do
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    return response.status, body


def test_a_24_mib_body_without_a_token_is_refused_before_parsing_and_rss_stays_flat(tmp_path):
    db = tmp_path / "reg.db"
    Registry(f"sqlite:///{db}", store=str(tmp_path / "artifacts"))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "registry", "serve", "--db", str(db), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if HTTP.get(f"http://127.0.0.1:{port}/api/v1/whoami").status_code == 401:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        server = psutil.Process(proc.pid)
        rss_before = server.memory_info().rss
        for chunked in (False, True):
            status, body = _send_big(port, 24 * MiB, chunked)
            assert status == 413, body
            assert '"error":"limit"' in body.replace(" ", "") and "at most 1048576" in body
        grown = server.memory_info().rss - rss_before
        assert grown < 8 * MiB, f"server RSS grew by {grown / MiB:.1f} MiB"
        assert HTTP.get(f"http://127.0.0.1:{port}/api/v1/whoami").status_code == 401  # still serving
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_slowloris_client_is_cut_off_in_the_head_and_in_the_body(owner):
    with Served(owner, header_timeout_s=1.0, body_timeout_s=1.0) as server:
        # head: one byte at a time, never finishing
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"GET /api/v1/whoami HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(40):
            try:
                sock.sendall(b"X")
                time.sleep(0.25)
                sock.setblocking(False)
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
        assert closed, "the server kept a connection whose request head never completed"
        sock.close()
        # body: the head is complete, the body trickles
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /api/v1/principals HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        answer = b""
        while chunk := sock.recv(4096):  # the head and the body may arrive apart; the server closes after them
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"not received within 1 s" in answer
        sock.close()
        assert HTTP.get(f"{server.url}/api/v1/whoami").status_code == 401  # others are still served


def test_an_oversized_header_is_refused(owner):
    with Served(owner) as server:
        response = HTTP.get(f"{server.url}/api/v1/whoami", headers={"X-Big": "a" * (64 << 10)})
        assert response.status_code == 431 and "request head over 16384 bytes" in response.json()["detail"]


def test_serving_off_loopback_without_tls_is_refused_with_a_hint(tmp_path):
    db = tmp_path / "reg.db"
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, _ = cli("registry", "serve", "--db", str(db), "--host", "0.0.0.0", "--port", "1")
    assert code == EXIT_CODES["usage"].code
    assert "refusing to serve the registry on 0.0.0.0 without TLS" in err.getvalue() and "--certs DIR" in err.getvalue()
    assert not db.exists()  # nothing was created


def test_the_client_never_sends_a_token_in_clear_to_another_machine():
    with pytest.raises(RegistryError, match="refusing to send a registry token in clear to http://10.1.2.3:8080"):
        RemoteRegistry("http://10.1.2.3:8080", "hfr_x")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from hybridfleet.security.certs import make_dev_pki

    return make_dev_pki(tmp_path_factory.mktemp("pki"), hosts=("127.0.0.1",), clients=("ci",))


def test_tls_from_the_project_pki_verifies_the_server_with_the_ca(owner, pki, monkeypatch):
    token = owner.add_principal("ci", "service")
    with Served(owner, certs=str(pki.directory)) as server:
        remote = RemoteRegistry(server.url, token, ca=str(pki.ca_cert))
        assert remote.whoami()["name"] == "ci"
        with pytest.raises(RegistryError, match="did not answer: .*CERTIFICATE_VERIFY_FAILED"):
            RemoteRegistry(server.url, token).whoami()  # the system trust store does not know the dev CA
        with pytest.raises(httpx.HTTPError):
            HTTP.get(f"http://127.0.0.1:{server.port}/api/v1/whoami")  # no plaintext on a TLS port
        code, out = cli("registry", "whoami", "--registry", server.url, "--token", token, "--ca", str(pki.ca_cert))
        assert code == 0 and '"name": "ci"' in out
        monkeypatch.setenv("HFLEET_REGISTRY_CA", str(pki.ca_cert))
        code, out = cli("registry", "whoami", "--registry", server.url, "--token", token)
        assert code == 0 and '"name": "ci"' in out


def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(owner, pki):
    token = owner.add_principal("ci", "service")
    with Served(owner, certs=str(pki.directory), client_ca=str(pki.ca_cert)) as server:
        with pytest.raises(RegistryError, match="did not answer"):
            RemoteRegistry(server.url, token, ca=str(pki.ca_cert)).whoami()
        client = pki.clients["ci"]
        remote = RemoteRegistry(server.url, token, ca=str(pki.ca_cert), client_cert=str(client.cert))
        assert remote.whoami()["name"] == "ci"
    with pytest.raises(AuthError, match="registry TLS files unusable"):
        RemoteRegistry(server.url, token, ca=str(pki.directory / "nope.pem"))
