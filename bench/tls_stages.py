"""Where TLS's CPU goes on one bulk-plane connection: sender and receiver, TLS against plaintext.

    python bench/tls_stages.py               # 64 MB frames, 8 timed (1 warm-up), loopback
    python bench/tls_stages.py --mb 4 --frames 2

bench/tls_cost.py measures what TLS adds to a whole exchange round (shard + workers); this
takes one connection apart. A forked receiver reads frames of ``--mb`` MB with
``recv_exact_into`` (the bulk plane's whole-frame read) while this process writes them with
``sendall``, over loopback TCP, once in plaintext, once on the native TLS connection
(`hybridfleet.ps.wire.tls`, the shard's and the workers' settings and the dev PKI) and,
with ``--python-tls``, once on Python's ssl module. Each side reads its own CPU-seconds
(``getrusage(RUSAGE_SELF)``, user and system apart) over the timed frames, so

    TLS adds, per GB = (TLS side's CPU - plaintext side's CPU) / GB moved

for the sender (encryption, record framing, the copies into OpenSSL's record buffer and the
write buffer) and the receiver (decryption, the copies from the reader's buffer into
OpenSSL's record buffer and out to the frame). The cipher's own cost per GB is AES-256-GCM
sealing (sender) and opening (receiver) 16 KiB records in the OpenSSL the native extension
links (``tls.native_seal_open``, sealing + opening: half of it each side). The last line is
JSON with those figures, the negotiated cipher and the OpenSSL version.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybridfleet.ps.server.bulk_server import server_ssl_context  # noqa: E402
from hybridfleet.ps.wire import tls  # noqa: E402
from hybridfleet.ps.wire.bulk import recv_exact_into  # noqa: E402
from hybridfleet.ps.worker.bulk_channel import client_ssl_context  # noqa: E402
from hybridfleet.security import make_dev_pki  # noqa: E402

RECORD_BYTES = 16 << 10
MODES = {"plaintext": None, "native": True, "python-ssl": False}


def cpu_s() -> tuple[float, float]:
    """(user, system) CPU-seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def receive(listener: socket.socket, mode: str, pki, size: int, frames: int, report_fd: int) -> None:
    """The forked receiver: accept, read 1 + ``frames`` frames, write its CPU of the timed ones."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if MODES[mode] is not None:
        conn = tls.wrap(server_ssl_context(str(pki.server_cert), str(pki.server_key)), conn, server_side=True,
                        native=MODES[mode])
    view = memoryview(np.empty(size, dtype=np.uint8))
    recv_exact_into(conn, view)  # warm-up: the frame's pages, the connection's buffers
    u0, s0 = cpu_s()
    for _ in range(frames):
        recv_exact_into(conn, view)
    u1, s1 = cpu_s()
    os.write(report_fd, json.dumps([u1 - u0, s1 - s0]).encode())
    conn.sendall(b"k")


def run(mode: str, pki, size: int, frames: int) -> dict:
    """CPU-seconds of the sender and the receiver for ``frames`` frames of ``size`` bytes in ``mode``."""
    listener = socket.create_server(("127.0.0.1", 0))
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 0
        try:
            receive(listener, mode, pki, size, frames, report_w)
        except BaseException:  # noqa: BLE001 - the parent sees the missing report
            code = 1
        os._exit(code)
    listener_addr = listener.getsockname()
    listener.close()
    try:
        sock = socket.create_connection(listener_addr, timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cipher = None
        if MODES[mode] is not None:
            sock = tls.wrap(client_ssl_context(str(pki.ca_cert)), sock, server_side=False,
                            server_hostname="127.0.0.1", native=MODES[mode])
            cipher = sock.cipher()[0]
        records = tls.records(sock)
        frame = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
        sock.sendall(frame)
        u0, s0 = cpu_s()
        started = time.perf_counter()
        for _ in range(frames):
            sock.sendall(frame)
        u1, s1 = cpu_s()
        if sock.recv(1) != b"k":
            raise RuntimeError(f"the {mode} receiver did not read every frame")
        wall = time.perf_counter() - started
        sock.close()
    finally:
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"the {mode} receiver failed (status {status})")
    recv_user, recv_sys = json.loads(os.read(report_r, 4096))
    os.close(report_r)
    os.close(report_w)
    return {"send_user_s": u1 - u0, "send_sys_s": s1 - s0, "recv_user_s": recv_user, "recv_sys_s": recv_sys,
            "wall_s": wall, "cipher": cipher, "records": records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="frame size in MB (default 64)")
    ap.add_argument("--frames", type=int, default=8, help="timed frames per run (default 8)")
    ap.add_argument("--python-tls", action="store_true", help="also measure Python's ssl module")
    args = ap.parse_args()
    if args.mb < 1 or args.frames < 1:
        ap.error(f"--mb and --frames must be at least 1 (got --mb {args.mb}, --frames {args.frames})")
    if tls.TLSConnection is None:
        sys.exit("bench/tls_stages.py: the native TLS extension (hybridfleet.ps.wire._tls) is not built: "
                 "run .ci/install-build-deps.sh, then pip install -e .")
    size = args.mb << 20
    gb = size * args.frames / 1e9
    modes = ["plaintext", "native"] + (["python-ssl"] if args.python_tls else [])
    with tempfile.TemporaryDirectory() as tmp:
        pki = make_dev_pki(Path(tmp) / "pki", clients=[])
        runs = {m: run(m, pki, size, args.frames) for m in modes}
    tls.native_seal_open(64 * RECORD_BYTES)  # warm-up
    started = time.process_time()
    tls.native_seal_open(size * args.frames)
    cipher_per_gb = (time.process_time() - started) / gb  # sealing + opening: both sides together
    plain = runs["plaintext"]
    result = {"bench": "tls_stages", "mb": args.mb, "frames": args.frames,
              "negotiated_cipher": runs["native"]["cipher"], "records": runs["native"]["records"], "stack_openssl": tls.native_openssl_version(),
              "cipher_cpu_s_per_gb": round(cipher_per_gb, 4)}
    print(f"{args.frames} frames of {args.mb} MB over loopback; CPU-s per GB moved (user + system)")
    for mode, r in runs.items():
        send = (r["send_user_s"] + r["send_sys_s"]) / gb
        recv = (r["recv_user_s"] + r["recv_sys_s"]) / gb
        per_gb = {f"{k[:-2]}_cpu_s_per_gb": round(r[k] / gb, 4)  # send_user_s -> send_user_cpu_s_per_gb
                  for k in ("send_user_s", "send_sys_s", "recv_user_s", "recv_sys_s")}
        result[mode] = {**per_gb, "wall_s_per_gb": round(r["wall_s"] / gb, 4)}
        print(f"  {mode:10s} sender {send:.3f} (user {r['send_user_s'] / gb:.3f}), "
              f"receiver {recv:.3f} (user {r['recv_user_s'] / gb:.3f})")
        if mode != "plaintext":
            adds_send = send - (plain["send_user_s"] + plain["send_sys_s"]) / gb
            adds_recv = recv - (plain["recv_user_s"] + plain["recv_sys_s"]) / gb
            result[mode].update({"tls_adds_send_cpu_s_per_gb": round(adds_send, 4),
                                 "tls_adds_recv_cpu_s_per_gb": round(adds_recv, 4),
                                 "tls_adds_over_cipher": round((adds_send + adds_recv) / cipher_per_gb, 3)})
            print(f"  {'':10s} TLS adds {adds_send:.3f} sending + {adds_recv:.3f} receiving; "
                  f"the cipher alone {cipher_per_gb:.3f} ({result[mode]['tls_adds_over_cipher']:.2f} x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
