"""Sealed records: the native TLS path's record layer after a TLS 1.3 handshake (see _tls.c).

Real TLS 1.3 on loopback between native connections, with a TCP relay in the middle that
captures, changes, drops or replays what passes. The records are checked against an
independent implementation of their construction: the TLS 1.3 exporter (RFC 8446 7.5)
computed here with `cryptography`'s HKDF from the exporter secret OpenSSL writes to the key
log, and AES-256-GCM from `cryptography` opening the captured records.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from hybridfleet.ps.server.bulk_server import server_ssl_context
from hybridfleet.ps.wire import tls
from hybridfleet.ps.wire.bulk import recv_exact_into
from hybridfleet.ps.worker.bulk_channel import client_ssl_context
from hybridfleet.security import make_dev_pki
from tests.needs import skip_outside_ci
from tests.test_ps_tls_native import _connect

NOT_BUILT = ("the hybridfleet.ps.wire._tls extension is not built (gcc and OpenSSL headers were missing at install: "
             "run .ci/install-build-deps.sh, then pip install -e .)")
pytestmark = skip_outside_ci(None if tls.TLSConnection else NOT_BUILT)
MAX_RECORD = 1 << 20
LABEL = b"EXPORTER-hybridfleet-sealed-records"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


def _contexts(pki, keylog: Path | None = None):
    server = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    client = client_ssl_context(str(pki.ca_cert), None, None)
    if keylog is not None:
        client.keylog_filename = str(keylog)
    return server, client


class Relay:
    """A TCP relay between a client and a server: forwards both ways, keeps a copy of every byte, and
    passes the client's sealed records through ``change(records) -> records`` once ``hold`` of them
    are in (TLS records, the handshake, go through at once)."""

    def __init__(self, target, change=None, hold: int = 0, pause_s: float = 0.0):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target, self.change, self.hold, self.pause_s = target, change, hold, pause_s
        self.up, self.down = bytearray(), bytearray()  # client -> server, server -> client
        self.threads = [threading.Thread(target=self._run, daemon=True)]
        self.threads[0].start()

    @property
    def address(self):
        return self.listener.getsockname()

    def _run(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        down = threading.Thread(target=self._pipe, args=(server, client, self.down, None), daemon=True)
        down.start()
        self.threads.append(down)
        self._pipe(client, server, self.up, self)

    def _pipe(self, src, dst, copy: bytearray, parser):
        pending, held = bytearray(), []
        try:
            while chunk := src.recv(1 << 20):
                copy += chunk
                if parser is None:
                    dst.sendall(chunk)
                    continue
                pending += chunk
                while True:  # whole records only: a TLS record goes on, a sealed one waits for `hold`
                    if len(pending) < 8:
                        break
                    if 20 <= pending[0] <= 24:
                        size = 5 + struct.unpack(">H", pending[3:5])[0]
                    else:
                        size = 8 + struct.unpack(">I", pending[4:8])[0] + 16
                    if len(pending) < size:
                        break
                    record, pending = bytes(pending[:size]), pending[size:]
                    if 20 <= record[0] <= 24 or self.change is None:
                        dst.sendall(record)
                        continue
                    held.append(record)
                    if len(held) >= self.hold:
                        for out in self.change(held):
                            dst.sendall(out)
                            time.sleep(self.pause_s)
                        held = []
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def _pair(pki, change=None, hold: int = 0, keylog: Path | None = None, timeout_s: float = 10, pause_s: float = 0.0):
    """(server, client, relay): native connections through a `Relay`."""
    server_ctx, client_ctx = _contexts(pki, keylog)
    listener = socket.create_server(("127.0.0.1", 0))
    relay = Relay(listener.getsockname(), change, hold, pause_s)
    result = {}

    def accept():
        conn, _ = listener.accept()
        conn.settimeout(timeout_s)
        result["server"] = tls.wrap(server_ctx, conn, server_side=True, native=True)

    thread = threading.Thread(target=accept)
    thread.start()
    sock = socket.create_connection(relay.address, timeout=timeout_s)
    client = tls.wrap(client_ctx, sock, server_side=False, server_hostname="127.0.0.1", native=True)
    thread.join(timeout_s)
    listener.close()
    return result["server"], client, relay


def _hkdf_expand_label(secret: bytes, label: bytes, context: bytes, length: int) -> bytes:
    info = struct.pack(">H", length) + bytes([6 + len(label)]) + b"tls13 " + label + bytes([len(context)]) + context
    return HKDFExpand(hashes.SHA384(), length, info).derive(secret)


def _exporter(secret: bytes, label: bytes, context: bytes, length: int) -> bytes:
    """TLS-Exporter(label, context, length) of RFC 8446 7.5 for a SHA-384 suite."""
    empty, ctx_hash = hashes.Hash(hashes.SHA384()), hashes.Hash(hashes.SHA384())
    ctx_hash.update(context)
    derived = _hkdf_expand_label(secret, label, empty.finalize(), 48)
    return _hkdf_expand_label(derived, b"exporter", ctx_hash.finalize(), length)


def _sealed_records(stream: bytes) -> list[bytes]:
    """The sealed records in a captured stream, after its TLS records."""
    out, at = [], 0
    while at < len(stream):
        if 20 <= stream[at] <= 24:
            at += 5 + struct.unpack(">H", stream[at + 3:at + 5])[0]
            continue
        size = 8 + struct.unpack(">I", stream[at + 4:at + 8])[0] + 16
        out.append(stream[at:at + size])
        at += size
    return out


def _open_all(records: list[bytes], secret: bytes, client_to_server: bool, rekey_bytes: int) -> tuple[bytes, int]:
    """Open captured records as the documented construction says; (plaintext, epochs used)."""
    plain, epoch, seq, under_key, keys = bytearray(), 0, 0, 0, None
    for record in records:
        if keys is None or under_key >= rekey_bytes:
            if keys is not None:
                epoch, seq, under_key = epoch + 1, 0, 0
            km = _exporter(secret, LABEL, struct.pack(">Q", epoch), 88)
            keys = (km[0:32], km[64:76]) if client_to_server else (km[32:64], km[76:88])
        key, iv = keys
        nonce = iv[:4] + (int.from_bytes(iv[4:], "big") ^ seq).to_bytes(8, "big")
        header, body = record[:8], record[8:]
        assert header[:4] == b"\xb7\x01\x00\x00" and struct.unpack(">I", header[4:])[0] == len(body) - 16
        opened = AESGCM(key).decrypt(nonce, body, header)
        plain += opened
        seq, under_key = seq + 1, under_key + len(opened)
    return bytes(plain), epoch + 1


def _exporter_secret(keylog: Path) -> bytes:
    lines = [line.split() for line in keylog.read_text().splitlines() if line.startswith("EXPORTER_SECRET ")]
    assert len(lines) == 1, keylog.read_text()
    return bytes.fromhex(lines[0][2])


def _roundtrip(server, client, up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    got_up, got_down = np.empty_like(up), np.empty_like(down)
    sender = threading.Thread(target=client.sendall, args=(memoryview(up),))
    sender.start()
    recv_exact_into(server, memoryview(got_up))
    sender.join(10)
    sender = threading.Thread(target=server.sendall, args=(memoryview(down),))
    sender.start()
    recv_exact_into(client, memoryview(got_down))
    sender.join(10)
    return got_up, got_down


@pytest.mark.parametrize("server_native,client_native,sealed_env,expected", [
    (True, True, "1", "sealed"), (True, False, "1", "tls"), (False, True, "1", "tls"), (True, True, "0", "tls"),
], ids=["native-native", "python-client", "python-server", "switched-off"])
def test_two_native_ends_agree_on_sealed_records_and_any_other_pair_keeps_tls_records(
        pki, monkeypatch, server_native, client_native, sealed_env, expected):
    # Prepare
    monkeypatch.setenv(tls.SEALED_SWITCH, sealed_env)
    server, client = _connect(*_contexts(pki), server_native, client_native)
    payload = np.random.default_rng(3).integers(0, 256, (2 << 20) + 5, dtype=np.uint8)

    # Execute
    got_up, got_down = _roundtrip(server, client, payload, payload[::-1].copy())

    # Assert: both ends agree on how records travel (as the benches report it), and every byte arrives
    assert tls.records(server) == tls.records(client) == expected
    if server_native and client_native:
        assert tls.records_between_native_ends() == expected
    assert np.array_equal(got_up, payload) and np.array_equal(got_down, payload[::-1])
    assert server.version() == client.version() == "TLSv1.3"
    server.close()
    client.close()


def test_sealed_records_are_aes_gcm_under_keys_from_the_tls_exporter_and_change_keys_on_schedule(pki, tmp_path):
    # Prepare: a key log (as ssl's keylog_filename writes it) and keys that change every 1.5 MiB
    from hybridfleet.ps.wire import _tls

    keylog = tmp_path / "keys.log"
    previous = _tls._set_rekey_bytes(3 << 19)
    try:
        server, client, relay = _pair(pki, keylog=keylog)
        up = np.random.default_rng(4).integers(0, 256, (5 << 20) + 3, dtype=np.uint8)
        down = np.random.default_rng(5).integers(0, 256, 777, dtype=np.uint8)

        # Execute: 5 MiB up, then 777 bytes down, each a frame read whole
        got_up, got_down = _roundtrip(server, client, up, down)
        client_records, server_records = client.records(), server.records()
        server.close()
        client.close()
        for thread in relay.threads:
            thread.join(10)
        relay.close()
    finally:
        _tls._set_rekey_bytes(previous)

    # Assert: what crossed the relay opens with keys computed here from the exporter secret alone
    secret = _exporter_secret(keylog)
    sent_up = _sealed_records(bytes(relay.up))
    opened_up, epochs_up = _open_all(sent_up, secret, client_to_server=True, rekey_bytes=3 << 19)
    opened_down, epochs_down = _open_all(_sealed_records(bytes(relay.down)), secret, False, 3 << 19)
    assert opened_up == up.tobytes() and opened_down == down.tobytes()
    assert np.array_equal(got_up, up) and np.array_equal(got_down, down)
    assert [len(r) - 24 for r in sent_up] == [MAX_RECORD] * 5 + [3]  # records of 1 MiB, the last one short
    assert epochs_up == 3 and epochs_down == 1  # 5 MiB at 1.5 MiB per key: the third key seals the last two
    assert client_records == ("sealed", 3, 1) and server_records == ("sealed", 1, 3)
    assert up.tobytes()[:4096] not in bytes(relay.up)  # the plaintext never crossed


def _flip_one_byte(records):
    first = bytearray(records[0])
    first[8 + 100] ^= 0x01
    return [bytes(first), *records[1:]]


@pytest.mark.parametrize("change,opened", [
    (_flip_one_byte, 0),
    (lambda records: records[1:], 0),
    (lambda records: [records[0], records[0], *records[1:]], 1),
    (lambda records: [records[1], records[0]], 0),
], ids=["changed", "dropped", "replayed", "reordered"])
def test_a_record_changed_dropped_replayed_or_reordered_fails_and_none_of_its_bytes_are_left(pki, change, opened):
    # Prepare: the relay holds the client's first two records (4000 bytes each) and passes them on changed
    server, client, relay = _pair(pki, change=change, hold=2)
    first, second = np.full(4000, 7, np.uint8), np.full(4000, 9, np.uint8)
    buf = np.full(8000, 0xAA, np.uint8)

    # Execute
    client.sendall(memoryview(first))
    client.sendall(memoryview(second))
    with pytest.raises(ssl.SSLError) as err:
        server.recv_exact_into(memoryview(buf))

    # Assert: records before the failed one are there, the failed one's place holds zeros (nothing
    # unauthenticated), the rest of the buffer is untouched, and the connection stays failed
    assert err.value.reason == "SEALED_RECORD_FAILED"
    assert "failed authentication (decryption failed or bad record mac)" in str(err.value)
    failed_at = 4000 * opened
    assert np.array_equal(buf[:failed_at], first[:failed_at])
    assert not buf[failed_at:failed_at + 4000].any()
    assert (buf[failed_at + 4000:] == 0xAA).all()
    with pytest.raises(ssl.SSLError, match="broke off earlier; the connection is unusable"):
        server.recv_exact_into(memoryview(bytearray(10)))
    server.close()
    client.close()
    relay.close()


def test_a_header_over_the_record_limit_is_refused_before_anything_is_read_for_it(pki):
    # Prepare: the relay says the first record is 2 GiB long
    def oversize(records):
        record = bytearray(records[0])
        record[4:8] = struct.pack(">I", 1 << 31)
        return [bytes(record)]

    server, client, relay = _pair(pki, change=oversize, hold=1)
    client.sendall(b"x" * 1000)

    # Execute / Assert
    with pytest.raises(ssl.SSLError, match=r"length is 0 or over its limit \(1 MiB\)"):
        server.recv_exact_into(memoryview(bytearray(1000)))
    server.close()
    client.close()
    relay.close()


def test_reads_smaller_than_a_record_take_it_in_pieces_after_it_is_authenticated(pki):
    # Prepare: one 1 MiB + 1 KiB write (two records); the reader asks for 1 byte, then odd sizes
    server, client, relay = _pair(pki)
    payload = np.random.default_rng(6).integers(0, 256, MAX_RECORD + 1024, dtype=np.uint8)
    sender = threading.Thread(target=client.sendall, args=(memoryview(payload),))
    sender.start()

    # Execute: recv (at least a byte), recv_into, then whole-frame reads across the record boundary
    pieces = [server.recv(1)]
    view = bytearray(4095)
    n = server.recv_into(view)
    pieces.append(bytes(view[:n]))
    for size in (100_000, MAX_RECORD - 100_000 - 1 - n + 10, 1014):
        buf = bytearray(size)
        server.recv_exact_into(memoryview(buf))
        pieces.append(bytes(buf))
    sender.join(10)

    # Assert
    assert b"".join(pieces) == payload.tobytes()
    server.close()
    client.close()
    relay.close()


def test_a_non_blocking_reader_takes_a_record_that_arrives_in_pieces_without_losing_a_byte(pki):
    # Prepare: the relay passes a 100,000-byte record on in 7 pieces, 50 ms apart; the reader never
    # waits (as the bulk plane's event loop reads a HELLO)
    def in_pieces(records):
        record = records[0]
        cuts = [0, 3, 8, 9, 5000, 50_000, 99_990, len(record)]
        return [record[a:b] for a, b in zip(cuts, cuts[1:])]

    server, client, relay = _pair(pki, change=in_pieces, hold=1, pause_s=0.05)
    payload = np.random.default_rng(7).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    client.sendall(payload)
    server.settimeout(0.0)

    # Execute: recv(1) until the record is in, counting the reads that would have waited
    would_wait, deadline = 0, time.monotonic() + 10
    while True:
        try:
            first = server.recv(1)
            break
        except TimeoutError:
            would_wait += 1
            assert time.monotonic() < deadline
            time.sleep(0.005)
    server.settimeout(10)
    rest = bytearray(len(payload) - 1)
    server.recv_exact_into(memoryview(rest))

    # Assert: the reads that came too early changed nothing; the record opened whole
    assert would_wait > 0
    assert first + bytes(rest) == payload
    assert server.records() == ("sealed", 1, 1)
    server.close()
    client.close()
    relay.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(garbage=st.one_of(
    st.binary(min_size=1, max_size=300),
    st.builds(lambda length, rest: b"\xb7\x01\x00\x00" + struct.pack(">I", length) + rest,
              st.one_of(st.integers(0, 200), st.integers(0, (1 << 32) - 1)), st.binary(max_size=64)),
))
def test_whatever_bytes_follow_the_handshake_the_reader_fails_cleanly_and_never_waits_past_the_end(pki, garbage):
    # Prepare: the relay replaces the client's first record with arbitrary bytes, then the client leaves
    server, client, relay = _pair(pki, change=lambda records: [garbage], hold=1)
    client.sendall(b"x")
    client.close()
    buf = bytearray(100)

    # Execute / Assert: an error the bulk plane maps (ssl.SSLError, EOFError), never a crash or a hang
    with pytest.raises((ssl.SSLError, EOFError)):
        server.recv_exact_into(memoryview(buf))
    assert bytes(buf) == bytes(100)  # nothing unauthenticated is left in the buffer
    server.close()
    relay.close()
