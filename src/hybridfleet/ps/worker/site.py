"""Site aggregation: the workers of one site reduce among themselves, one leader talks to the shards.

WAN bytes then do not grow with the number of workers per site. The leader
(site rank 0) listens on the site's network (``HFLEET_SITE_HUB=host:port``);
each follower sends its dense gradient every step and receives the parameters
the leader pulled, so every worker of the site trains on the same values.

The reduce uses plain TCP frames rather than a framework collective so that one
mechanism serves torch and paddle workers alike and needs no process group
set-up; the traffic stays inside the site. A follower that fails is dropped from
the reduce (the supervisor restarts it and it reconnects); a leader that fails
takes its followers down with it, and they reconnect to its restart.

Frame: 8-byte little-endian length, then the payload. Follower -> leader:
``hello`` (JSON) once, then one gradient per step (float32, parameters in sorted
name order). Leader -> follower: ``u64 step`` + the parameters, same layout.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import numpy as np

from hybridfleet.errors import ProtocolError
from hybridfleet.obs.log import get_logger

log = get_logger("ps.site")

DTYPE = np.dtype("<f4")
_LEN = struct.Struct("<Q")
CONNECT_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 600.0


def _send(sock: socket.socket, payload: bytes | memoryview) -> int:
    sock.sendall(_LEN.pack(len(payload)))
    sock.sendall(payload)
    return _LEN.size + len(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("site peer closed the connection")
        got += k
    return buf


def _recv(sock: socket.socket, max_bytes: int) -> bytearray:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > max_bytes:
        raise ProtocolError(f"site frame of {n} bytes exceeds the expected {max_bytes}")
    return _recv_exact(sock, n)


def flatten(arrays: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[n], dtype=DTYPE).reshape(-1) for n in names]) if names else \
        np.zeros(0, DTYPE)


def unflatten(vector: np.ndarray, shapes: dict[str, tuple[int, ...]], names: list[str]) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    for n in names:
        size = int(np.prod(shapes[n])) if shapes[n] else 1
        out[n] = vector[offset:offset + size].reshape(shapes[n])
        offset += size
    return out


class SiteHub:
    """The leader's side: accepts followers, gathers and sums their gradients, sends parameters."""

    def __init__(self, address: str, expected_followers: int, numel: int):
        host, port = address.rsplit(":", 1)
        self.numel = numel
        self.expected_followers = expected_followers
        self._server = socket.create_server((host, int(port)), reuse_port=False)
        self._server.settimeout(0.5)
        self._pending: list[socket.socket] = []
        self._followers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lan_bytes = 0
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="site-hub")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            conn.settimeout(STEP_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = json.loads(_recv(conn, 4096))
            except (OSError, ValueError, ProtocolError) as err:
                log.warning("site_hello_failed", error=str(err))
                conn.close()
                continue
            log.info("site_follower_connected", site_rank=hello.get("site_rank"))
            with self._lock:
                self._pending.append(conn)

    def wait_for_followers(self, timeout_s: float = CONNECT_TIMEOUT_S) -> int:
        """Block until the expected followers connected (or the timeout); returns how many did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self._pending) + len(self._followers) >= self.expected_followers:
                    break
            time.sleep(0.05)
        with self._lock:
            return len(self._pending) + len(self._followers)

    def admit(self, params: np.ndarray, step: int) -> None:
        """Send the current parameters to followers that connected since the last step."""
        with self._lock:
            new, self._pending = self._pending, []
        for conn in new:
            try:
                self.lan_bytes += _send(conn, _LEN.pack(step) + params.tobytes())
                self._followers.append(conn)
            except OSError:
                conn.close()

    def gather(self, own: np.ndarray) -> tuple[np.ndarray, int]:
        """Sum the leader's gradient with every follower's; returns (sum, contributors)."""
        total = own.astype(DTYPE, copy=True)
        alive = []
        for conn in self._followers:
            try:
                g = np.frombuffer(_recv(conn, self.numel * DTYPE.itemsize), dtype=DTYPE)
                if g.size != self.numel:
                    raise ProtocolError(f"follower sent {g.size} gradient values, expected {self.numel}")
                if not np.isfinite(g).all():
                    raise ProtocolError("follower sent non-finite gradient values")
                total += g
                self.lan_bytes += _LEN.size + g.nbytes
                alive.append(conn)
            except (OSError, ProtocolError) as err:
                log.warning("site_follower_dropped", error=str(err))
                conn.close()
        self._followers = alive
        return total, 1 + len(alive)

    def broadcast(self, params: np.ndarray, step: int) -> None:
        payload = _LEN.pack(step) + params.tobytes()
        alive = []
        for conn in self._followers:
            try:
                self.lan_bytes += _send(conn, payload)
                alive.append(conn)
            except OSError as err:
                log.warning("site_follower_dropped", error=str(err))
                conn.close()
        self._followers = alive

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        for conn in self._followers + self._pending:
            conn.close()


class SiteLink:
    """A follower's side: sends gradients to the site leader, receives parameters."""

    def __init__(self, address: str, site_rank: int, numel: int, timeout_s: float = CONNECT_TIMEOUT_S):
        host, port = address.rsplit(":", 1)
        self.numel = numel
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"site leader at {address} did not answer within {timeout_s:.0f} s") from None
                time.sleep(0.1)
        self.sock.settimeout(STEP_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lan_bytes = _send(self.sock, json.dumps({"site_rank": site_rank}).encode())

    def receive(self) -> tuple[int, np.ndarray]:
        """(step, parameters) from the leader."""
        frame = _recv(self.sock, _LEN.size + self.numel * DTYPE.itemsize)
        (step,) = _LEN.unpack_from(frame)
        params = np.frombuffer(frame, dtype=DTYPE, offset=_LEN.size)
        if params.size != self.numel:
            raise ProtocolError(f"site leader sent {params.size} parameter values, expected {self.numel}")
        self.lan_bytes += _LEN.size + len(frame)
        return step, params

    def send(self, grads: np.ndarray) -> None:
        self.lan_bytes += _send(self.sock, grads.astype(DTYPE, copy=False).tobytes())

    def close(self) -> None:
        self.sock.close()
