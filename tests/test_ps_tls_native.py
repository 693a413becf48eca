"""The bulk plane's native TLS connection (C record loop over OpenSSL) against Python's ssl module.

Real TLS 1.3 on loopback sockets with the project's dev PKI: the same handshake checks
(CA, host name, IP address, client certificates), the same exception classes and texts,
interop in both directions, timeouts, deadlines and peers that vanish mid-frame. The
bulk-plane suite itself (test_ps_bulk.py) runs with the native path by default and with
``HFLEET_NATIVE_TLS=0`` in CI (.ci/run).
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ps.server.bulk_server import server_ssl_context
from hybridfleet.ps.wire import tls
from hybridfleet.ps.wire.bulk import recv_exact_into
from hybridfleet.ps.worker.bulk_channel import client_ssl_context
from hybridfleet.security import make_dev_pki
from tests.needs import missing, skip_outside_ci

NOT_BUILT = ("the hybridfleet.ps.wire._tls extension is not built (gcc and OpenSSL headers were missing at install: "
             "run .ci/install-build-deps.sh, then pip install -e .)")
NO_HEADERS = "OpenSSL headers (/usr/include/openssl/ssl.h) are not installed: run .ci/install-build-deps.sh"
needs_native = skip_outside_ci(None if tls.TLSConnection else NOT_BUILT)
BOTH = [pytest.param(True, id="native"), pytest.param(False, id="python-ssl")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


def _server_ctx(pki, mutual: bool = False) -> ssl.SSLContext:
    return server_ssl_context(str(pki.server_cert), str(pki.server_key), str(pki.ca_cert) if mutual else None)


def _client_ctx(pki, ca: Path | None = None, with_cert: bool = False) -> ssl.SSLContext:
    pair = pki.clients["worker"]
    return client_ssl_context(str(ca or pki.ca_cert), str(pair.cert) if with_cert else None,
                              str(pair.key) if with_cert else None)


def _connect(server_ctx, client_ctx, server_native: bool, client_native: bool, hostname: str = "127.0.0.1",
             timeout_s: float = 10):
    """(server side, client side) after both handshakes; each is the connection or the exception it raised."""
    listener = socket.create_server(("127.0.0.1", 0))
    result = {}

    def accept():
        conn, _ = listener.accept()
        conn.settimeout(timeout_s)
        try:
            result["server"] = tls.wrap(server_ctx, conn, server_side=True, native=server_native)
        except Exception as err:  # noqa: BLE001 - handed to the test
            result["server"] = err
            conn.close()

    thread = threading.Thread(target=accept)
    thread.start()
    sock = socket.create_connection(listener.getsockname(), timeout=timeout_s)
    try:
        client = tls.wrap(client_ctx, sock, server_side=False, server_hostname=hostname, native=client_native)
    except Exception as err:  # noqa: BLE001
        client = err
        sock.close()
    thread.join(timeout_s)
    listener.close()
    return result["server"], client


def _without_location(message: str) -> str:
    """ssl's messages end in "(_ssl.c:1006)"; the rest is what both paths must agree on."""
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", message)


@pytest.mark.parametrize("server_native,client_native", [(True, True), (True, False), (False, True)],
                         ids=["native-native", "native-server-python-client", "python-server-native-client"])
@needs_native
def test_handshake_and_whole_frames_both_ways_and_interop(pki, server_native, client_native):
    # Prepare: a TLS 1.3 connection, either side native or Python ssl
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), server_native, client_native)
    payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    received, echoed = np.empty_like(payload), np.empty_like(payload)

    # Execute: 3 MB up, the same back, each read as one whole frame
    client.sendall(memoryview(payload))
    recv_exact_into(server, memoryview(received))
    server.sendall(memoryview(received))
    recv_exact_into(client, memoryview(echoed))

    # Assert: real TLS 1.3, the native class where asked for, every byte intact
    assert server.version() == client.version() == "TLSv1.3"
    assert isinstance(server, tls.TLSConnection) is server_native
    assert isinstance(client, tls.TLSConnection) is client_native
    assert np.array_equal(received, payload) and np.array_equal(echoed, payload)
    server.close()
    client.close()


@needs_native
def test_frames_sent_back_to_back_are_read_in_pieces_of_any_size(pki):
    # Prepare: frames of many sizes in one stream, so that a read ends with the next frame's bytes
    # already received (less than one record, more than one record, most of the receive buffer)
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), True, True)
    sizes = [1 << 20, 100, 40 << 10, 1, (1 << 20) + 7, 5, 300 << 10, 17 << 10, 3]
    stream = np.random.default_rng(1).integers(0, 256, sum(sizes), dtype=np.uint8)
    sender = threading.Thread(target=client.sendall, args=(memoryview(stream),))

    # Execute: the whole stream sent at once; read back frame by frame, small reads by recv
    sender.start()
    pieces = []
    for n in sizes:
        if n <= 5:
            pieces.append(np.frombuffer(_recv_by_recv(server, n), dtype=np.uint8))
        else:
            buf = np.empty(n, dtype=np.uint8)
            recv_exact_into(server, memoryview(buf))
            pieces.append(buf)
    sender.join(10)

    # Assert: every byte in order, on the cipher the TLS cost bench compares with
    assert np.array_equal(np.concatenate(pieces), stream)
    assert server.cipher() == client.cipher() == ("TLS_AES_256_GCM_SHA384", "TLSv1.3", 256)
    server.close()
    client.close()


def _recv_by_recv(conn, n: int) -> bytes:
    """``n`` bytes read by ``recv`` calls (each returns what is there, at most what is asked)."""
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        assert got, "end of stream before the frame's end"
        out += got
    return out


@needs_native
def test_the_cipher_alone_runs_in_the_extensions_openssl_and_bad_sizes_are_refused():
    # Execute / Assert: 1 MiB sealed and opened in TLS records (each tag checked on opening)
    assert tls.native_seal_open(1 << 20) is True
    assert tls.native_seal_open(1000, 300) is True  # a last record shorter than the others
    assert tls.native_openssl_version() == tls._tls.OPENSSL_VERSION
    for total, record in ((-1, 16384), (100, 0), (100, (1 << 20) + 1)):
        with pytest.raises(ValueError, match=r"seal_open needs total >= 0 and 0 < record <= 1 MiB"):
            tls.native_seal_open(total, record)


OPENSSL_PREFIX = Path(os.environ.get("HFLEET_OPENSSL_PREFIX", "/opt/hybridfleet/openssl"))


@needs_native
def test_the_extension_carries_the_built_openssl_inside_it_and_exports_none_of_it():
    # Prepare: the version the built OpenSSL's headers declare; Python's own ssl module loaded
    if not (OPENSSL_PREFIX / ".built").exists():
        missing(f"no static OpenSSL is built in {OPENSSL_PREFIX}: run .ci/install-openssl.sh, then make test "
                f"relinks the extension (without it the extension links the system's OpenSSL)")
    header = (OPENSSL_PREFIX / "include" / "openssl" / "opensslv.h").read_text()
    built = re.search(r'#\s*define OPENSSL_FULL_VERSION_STR "([^"]+)"', header).group(1)
    so_path = tls._tls.__file__

    # Execute: look the extension's own dynamic symbols up, apart from every other library
    # (RTLD_NOLOAD: the handle of the copy already loaded)
    handle = ctypes.CDLL(so_path, mode=os.RTLD_LOCAL | os.RTLD_NOLOAD)

    # Assert: the extension runs the built OpenSSL, needs no libssl/libcrypto of the system's (the one
    # Python's ssl module loads) and lends it none of its symbols
    assert tls.native_openssl_version().startswith(f"OpenSSL {built} ")
    for symbol in ("SSL_new", "SSL_write", "EVP_EncryptUpdate", "OpenSSL_version"):
        assert not hasattr(handle, symbol), symbol
    assert hasattr(handle, "PyInit__tls")
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        subprocess.run(["readelf", "-d", so_path], capture_output=True, text=True, check=True).stdout)
    assert needed and not [lib for lib in needed if lib.startswith(("libssl", "libcrypto"))], needed
    assert tls.native_seal_open(1 << 20) is True


@needs_native
@pytest.mark.parametrize("hostname,verify_text", [
    ("wrong.example", "Hostname mismatch, certificate is not valid for 'wrong.example'."),
    ("127.0.0.2", "IP address mismatch, certificate is not valid for '127.0.0.2'."),
])
def test_a_name_the_certificate_does_not_list_fails_as_the_ssl_module_says(pki, hostname, verify_text):
    # Execute: the same wrong name, once on each path
    errors = {native: _connect(_server_ctx(pki), _client_ctx(pki), True, native, hostname=hostname)[1]
              for native in (True, False)}

    # Assert: the same exception class, reason, verify code and text
    native, python = errors[True], errors[False]
    assert isinstance(native, ssl.SSLCertVerificationError) and isinstance(python, ssl.SSLCertVerificationError)
    assert native.reason == python.reason == "CERTIFICATE_VERIFY_FAILED"
    assert native.verify_code == python.verify_code
    assert native.verify_message == python.verify_message == verify_text
    assert str(native) == _without_location(str(python))


@needs_native
def test_a_server_signed_by_another_ca_is_refused_as_the_ssl_module_refuses_it(pki, tmp_path):
    other = make_dev_pki(tmp_path / "other-ca")
    errors = {native: _connect(_server_ctx(pki), _client_ctx(pki, ca=other.ca_cert), True, native)[1]
              for native in (True, False)}
    assert isinstance(errors[True], ssl.SSLCertVerificationError)
    assert "CERTIFICATE_VERIFY_FAILED" in str(errors[True])
    assert str(errors[True]) == _without_location(str(errors[False]))


@needs_native
@pytest.mark.parametrize("server_native", BOTH)
def test_mutual_tls_shows_the_client_certificate_to_the_server(pki, server_native):
    # Prepare / Execute: a client with its certificate; the native server and ssl describe it alike
    server, client = _connect(_server_ctx(pki, mutual=True), _client_ctx(pki, with_cert=True), server_native, True)
    client.sendall(b"ping")
    assert server.recv(4) == b"ping"
    reference, _ = _connect(_server_ctx(pki, mutual=True), _client_ctx(pki, with_cert=True), False, False)

    # Assert
    cert = server.getpeercert()
    assert cert == reference.getpeercert()
    assert dict(rdn[0] for rdn in cert["subject"])["commonName"]
    assert server.getpeercert(binary_form=True) == reference.getpeercert(binary_form=True)
    for conn in (server, client, reference):
        conn.close()


@needs_native
@pytest.mark.parametrize("server_native", BOTH)
def test_mutual_tls_without_a_client_certificate_is_refused(pki, server_native):
    # Execute: TLS 1.3 finishes the client's handshake first; the refusal arrives as an alert
    server, client = _connect(_server_ctx(pki, mutual=True), _client_ctx(pki), server_native, True)
    assert isinstance(server, ssl.SSLError)
    # a native server chose sealed records before it refused: the client reads the alert through them
    assert client.records()[0] == ("sealed" if server_native else "tls")
    with pytest.raises(ssl.SSLError) as err:
        client.recv(1)

    # Assert: the same reason the ssl module reports
    assert err.value.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in str(server)
    client.close()


@needs_native
def test_a_peer_that_closes_mid_frame_ends_the_read_with_eof(pki):
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), True, True)
    client.sendall(b"\1" * 10_240)
    client.shutdown(socket.SHUT_WR)  # a FIN after 10 KiB of a 100 KiB frame
    with pytest.raises(EOFError, match="connection closed after 10240 of 102400 bytes"):
        server.recv_exact_into(memoryview(bytearray(102_400)))
    server.close()
    client.close()


@needs_native
def test_a_silent_peer_times_out_and_a_trickling_one_meets_the_deadline(pki):
    # Prepare
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), True, True)
    buf = memoryview(bytearray(1000))

    # Execute / Assert: settimeout bounds each wait for progress, as a socket's timeout does
    server.settimeout(0.2)
    with pytest.raises(TimeoutError, match="The read operation timed out"):
        server.recv_exact_into(buf)

    # a byte every 50 ms is progress, but not the whole frame before its deadline
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.05):
            client.sendall(b"x")

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        with pytest.raises(TimeoutError):
            server.recv_exact_into(buf, deadline=time.monotonic() + 0.5)
    finally:
        stop.set()
        thread.join()
    server.close()
    client.close()


@needs_native
def test_a_write_to_a_peer_that_never_reads_meets_its_deadline(pki):
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), True, True)
    with pytest.raises(TimeoutError, match="The write operation timed out"):
        client.sendall(bytes(64 << 20), deadline=time.monotonic() + 0.3)
    server.close()
    client.close()


@needs_native
def test_shutdown_from_another_thread_wakes_a_blocked_reader_and_close_is_final(pki):
    # Prepare: a reader blocked with no timeout (a shard's connection between steps)
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), True, True)
    server.settimeout(None)
    outcome = []

    def read():
        try:
            server.recv_exact_into(memoryview(bytearray(10)))
        except (EOFError, OSError) as err:
            outcome.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(0.1)

    # Execute: what BulkServer.stop does
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)

    # Assert: the reader came back with an end of stream; the closed connection refuses further use
    assert not thread.is_alive() and len(outcome) == 1
    assert server.fileno() == -1
    with pytest.raises(OSError):
        server.sendall(b"x")
    client.close()


@needs_native
def test_forced_off_by_the_environment_the_ssl_module_serves(pki, monkeypatch):
    monkeypatch.setenv(tls.ENV_SWITCH, "0")
    server, client = _connect(_server_ctx(pki), _client_ctx(pki), None, None)
    assert isinstance(server, ssl.SSLSocket) and isinstance(client, ssl.SSLSocket)
    monkeypatch.delenv(tls.ENV_SWITCH)
    assert tls.native_available()
    server.close()
    client.close()


@needs_native
def test_a_context_without_recorded_files_uses_the_ssl_module(pki):
    bare = ssl.create_default_context(cafile=str(pki.ca_cert))
    server, client = _connect(_server_ctx(pki), bare, True, True)
    assert isinstance(client, ssl.SSLSocket) and isinstance(server, tls.TLSConnection)
    server.close()
    client.close()


@needs_native
def test_the_bulk_plane_runs_on_the_native_connection(tmp_path, monkeypatch):
    # Prepare / Execute: a shard and a worker push through the bulk plane
    from tests.ps_helpers import join_and_init, start_cluster
    from tests.test_ps_server import encoded, grads

    monkeypatch.delenv(tls.ENV_SWITCH, raising=False)
    cluster = start_cluster(tmp_path)
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        client.push(encoded(client, grads(1.0)), codec="none", base_versions=[0])

        # Assert: both ends of the bulk connection are native TLS 1.3
        sock = client._bulk[0]._sock
        assert isinstance(sock, tls.TLSConnection) and sock.version() == "TLSv1.3"
        with cluster.servers[0].bulk._lock:
            conns = list(cluster.servers[0].bulk._conns)
        assert conns and all(isinstance(c, tls.TLSConnection) for c in conns)
        assert cluster.servers[0].state.version == 1
        client.close()
    finally:
        cluster.stop()


@skip_outside_ci(None if Path("/usr/include/openssl/ssl.h").exists() else NO_HEADERS)
def test_the_extension_is_built_where_openssl_headers_exist():
    assert tls._tls is not None, "pip install -e . should have built hybridfleet.ps.wire._tls"
    assert tls._tls.OPENSSL_VERSION.startswith("OpenSSL")
