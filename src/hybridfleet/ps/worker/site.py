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

`hfleet run` gives the site ``HFLEET_SITE_HUB=127.0.0.1:0`` and ``HFLEET_SITE_HUB_FILE``: the
leader binds a free port itself and writes it to that file (a restarted leader binds the port
the file names while it is free), and followers connect to the port the file names, read
again at each try. No port is picked for the leader and released, for another process to take.

Who may join (TLS, each follower's own token, at most the site's followers) is
`hybridfleet.ps.worker.site_security`'s to decide. No peer holds up another: each
connection's TLS handshake and hello run in their own thread under a deadline
(`HANDSHAKE_TIMEOUT_S`), pending connections are bounded per source address
(`hybridfleet.ps.wire.admission`), and every frame, once its first byte is in, must
arrive within a deadline set by its size (`frame_deadline`).

Frame: 8-byte little-endian length, then the payload; every length is checked against
what the job's model needs before anything is allocated. Follower -> leader: ``hello``
(JSON: site rank, token) once, answered by the leader's JSON verdict (``ok`` or
``error``), then one gradient per step (float32, parameters in sorted name order),
followed, when the hub and link count ``params`` parameters, by one byte per parameter:
1 when the follower had a gradient for it this step, 0 when not (its values are then
zeros). Leader -> follower: ``u64 step`` + the parameters, same layout.

A parameter no worker of the site had a gradient for is left out of the site's push, so
the shards do not step it (as with a direct push); one some workers had a gradient for
carries their sum, the others counting as zeros (as the shards' mean counts a key a
contributor left out).
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import threading
import time

import numpy as np

from hybridfleet.codec.base import all_finite
from hybridfleet.errors import AuthError, ProtocolError
from hybridfleet.obs.log import get_logger
from hybridfleet.portfile import read_port_file, write_port_file
from hybridfleet.ps.wire.admission import HandshakeSlots
from hybridfleet.ps.worker.site_security import HubSecurity, LinkSecurity
from hybridfleet.ps.wire.buffers import DTYPE  # the wire's float32, little-endian

log = get_logger("ps.site")

_LEN = struct.Struct("<Q")
HUB_FILE_ENV = "HFLEET_SITE_HUB_FILE"
CONNECT_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 600.0       # how long the leader waits for a follower's next gradient to start
HANDSHAKE_TIMEOUT_S = 10.0   # TLS handshake, hello and verdict together
HELLO_MAX_BYTES = 16 << 10
PENDING_HANDSHAKES = 16
PENDING_PER_SOURCE = 4
# Once its first byte is in, a frame may take FRAME_DEADLINE_S plus one second per MIN_FRAME_RATE bytes.
FRAME_DEADLINE_S = 30.0
MIN_FRAME_RATE = 256 << 10


def frame_deadline(nbytes: int) -> float:
    """Seconds a peer has to deliver the rest of a frame of ``nbytes`` payload bytes."""
    return FRAME_DEADLINE_S + nbytes / MIN_FRAME_RATE


def _send(sock: socket.socket, payload: bytes | memoryview) -> int:
    sock.sendall(_LEN.pack(len(payload)))
    sock.sendall(payload)
    return _LEN.size + len(payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"site peer sent {got} of {n} bytes before its deadline")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("site peer closed the connection")
        got += k
    return buf


def _recv(sock: socket.socket, max_bytes: int, first_byte_timeout_s: float = STEP_TIMEOUT_S,
          deadline: float | None = None) -> bytearray:
    """One frame of at most ``max_bytes``: its first byte within ``first_byte_timeout_s`` (or by
    ``deadline``), the rest within `frame_deadline` of its size (and by ``deadline``)."""
    start = time.monotonic()
    first_by = start + first_byte_timeout_s if deadline is None else deadline
    head = _recv_exact(sock, 1, first_by)
    by = time.monotonic() + FRAME_DEADLINE_S if deadline is None else deadline
    head += _recv_exact(sock, _LEN.size - 1, by)
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        raise ProtocolError(f"site frame of {n} bytes exceeds the expected {max_bytes}")
    by = time.monotonic() + frame_deadline(n) if deadline is None else deadline
    return _recv_exact(sock, n, by)


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
    """The leader's side: admits the site's followers, gathers and sums their gradients, sends parameters.

    ``security`` says who may join (`HubSecurity`); at most ``security.workers - 1``
    followers, one connection per follower (a follower that reconnects with its own token
    replaces its old connection, as after a restart).
    """

    def __init__(self, address: str, expected_followers: int, numel: int, security: HubSecurity,
                 sizes: list[int] | None = None):
        """``sizes``: the element count of each parameter in frame order; given, each follower's
        gradient carries which parameters it had a gradient for (see `gather_present`)."""
        host, port = address.rsplit(":", 1)
        if expected_followers > security.workers - 1:
            raise ValueError(f"site {security.site!r} has {security.workers - 1} followers, not {expected_followers}")
        if sizes is not None and sum(sizes) != numel:
            raise ValueError(f"parameter sizes add up to {sum(sizes)} elements, not {numel}")
        self.numel = numel
        self.sizes = list(sizes or [])
        self.expected_followers = expected_followers
        self.security = security
        self._server = socket.create_server((host, int(port)), reuse_port=False)
        self._server.settimeout(0.5)
        self.port = self._server.getsockname()[1]
        self._pending: dict[str, socket.socket] = {}    # worker id -> admitted connection, not sent to yet
        self._followers: list[tuple[str, socket.socket]] = []
        self._follower_ids: set[str] = set()
        self._admitting: set[str] = set()  # verdict being sent
        self._slots = HandshakeSlots(PENDING_HANDSHAKES, PENDING_PER_SOURCE)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lan_bytes = 0
        self.refused = 0  # connections refused so far (bad hello, bad token, over the cap)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="site-hub")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._slots.take(conn.fileno(), peer[0])
            threading.Thread(target=self._handshake, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True,
                             name="site-hub-handshake").start()

    def _handshake(self, conn: socket.socket, who: str) -> None:
        """TLS, hello and verdict of one connection, all by one deadline; admitted connections wait
        in ``_pending`` for the next `admit`."""
        fd, deadline = conn.fileno(), time.monotonic() + HANDSHAKE_TIMEOUT_S
        admitted = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.security.ssl_context is not None:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                # The handshake runs outside ``wrap_socket``: a failed one there closes the
                # descriptor at once, and the next accepted connection, given the same number,
                # would lose its slot to this one's release below. Closed only in `finally`.
                conn = self.security.ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                conn.do_handshake()
            try:
                raw = _recv(conn, HELLO_MAX_BYTES, deadline=deadline)
            except ProtocolError as err:
                raise AuthError(f"hello refused: {err}") from None
            try:
                hello = json.loads(raw)
            except ValueError:
                raise AuthError("malformed hello (expected a JSON object)") from None
            if not isinstance(hello, dict):
                raise AuthError("malformed hello (expected a JSON object)")
            wid = self.security.follower_id(hello, conn)
            with self._lock:
                if wid in self._admitting:
                    raise AuthError(f"worker {wid} is being admitted on another connection right now")
                known = set(self._pending) | self._follower_ids
                if wid not in known and len(known) >= self.expected_followers:
                    raise AuthError(f"site {self.security.site!r} already has {len(known)} followers "
                                    f"(at most {self.expected_followers})")
                if not self._slots.release(fd):
                    raise ConnectionError("evicted before its handshake completed")
                self._admitting.add(wid)
            try:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                _send(conn, json.dumps({"ok": True}).encode())  # before `admit` may write to it
                conn.settimeout(STEP_TIMEOUT_S)
                with self._lock:
                    old = self._pending.pop(wid, None)
                    self._pending[wid] = conn
                    admitted = True
            finally:
                with self._lock:
                    self._admitting.discard(wid)
            if old is not None:
                old.close()
            log.info("site_follower_connected", worker=wid, peer=who)
        except AuthError as err:
            self.refused += 1
            log.warning("site_follower_refused", peer=who, reason=str(err))
            try:
                conn.settimeout(1.0)
                _send(conn, json.dumps({"ok": False, "error": str(err)}).encode())
            except OSError:
                pass
        except (OSError, ProtocolError, ssl.SSLError) as err:
            self.refused += 1
            log.warning("site_hello_failed", peer=who, error=str(err) or type(err).__name__)
        finally:
            self._slots.release(fd)
            if not admitted:
                conn.close()

    @property
    def followers(self) -> int:
        """Followers admitted (waiting for the next step or already reducing)."""
        with self._lock:
            return len(set(self._pending) | self._follower_ids)

    def wait_for_followers(self, timeout_s: float = CONNECT_TIMEOUT_S) -> int:
        """Block until the expected followers connected (or the timeout); returns how many did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.followers < self.expected_followers:
            time.sleep(0.05)
        return self.followers

    def admit(self, params: np.ndarray, step: int) -> None:
        """Send the current parameters to followers admitted since the last step (a follower's new
        connection replaces its old one)."""
        with self._lock:
            new, self._pending = self._pending, {}
        for wid, conn in new.items():
            for old in [c for w, c in self._followers if w == wid]:
                old.close()
            self._followers = [(w, c) for w, c in self._followers if w != wid]
            try:
                self.lan_bytes += _send(conn, _LEN.pack(step) + params.tobytes())
                self._followers.append((wid, conn))
            except OSError:
                conn.close()
        self._sync_ids()

    def _sync_ids(self) -> None:
        with self._lock:
            self._follower_ids = {w for w, _ in self._followers}

    def gather(self, own: np.ndarray) -> tuple[np.ndarray, int]:
        """Sum the leader's gradient with every follower's; returns (sum, contributors)."""
        total, _, contributors = self.gather_present(own, np.ones(len(self.sizes), np.uint8))
        return total, contributors

    def gather_present(self, own: np.ndarray, own_present: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Sum the leader's gradient with every follower's; returns (sum, present, contributors):
        ``present[i]`` is True when some worker of the site had a gradient for parameter ``i``."""
        total = own.astype(DTYPE, copy=True)
        present = np.asarray(own_present, dtype=bool).copy()
        if present.size != len(self.sizes):
            raise ValueError(f"{present.size} presence flags for {len(self.sizes)} parameters")
        alive = []
        for wid, conn in self._followers:
            try:
                frame = _recv(conn, self.numel * DTYPE.itemsize + len(self.sizes))
                g, theirs = self._parse_gradient(frame)
                total += g
                present |= theirs
                self.lan_bytes += _LEN.size + len(frame)
                alive.append((wid, conn))
            except (OSError, ProtocolError, ssl.SSLError) as err:
                log.warning("site_follower_dropped", worker=wid, error=str(err))
                conn.close()
        self._followers = alive
        self._sync_ids()
        return total, present, 1 + len(alive)

    def _parse_gradient(self, frame: bytearray) -> tuple[np.ndarray, np.ndarray]:
        """A follower's (gradient, presence flags), every length and value checked."""
        expected = self.numel * DTYPE.itemsize + len(self.sizes)
        if len(frame) != expected:
            raise ProtocolError(f"follower sent {len(frame)} gradient bytes, expected {expected}")
        g = np.frombuffer(frame, dtype=DTYPE, count=self.numel)
        flags = np.frombuffer(frame, dtype=np.uint8, offset=self.numel * DTYPE.itemsize)
        if not all_finite(g):
            raise ProtocolError("follower sent non-finite gradient values")
        if (flags > 1).any():
            raise ProtocolError("follower sent presence flags other than 0 and 1")
        offset = 0
        for size, flag in zip(self.sizes, flags):
            if not flag and g[offset:offset + size].any():
                raise ProtocolError("follower sent values for a parameter it had no gradient for")
            offset += size
        return g, flags.astype(bool)

    def broadcast(self, params: np.ndarray, step: int) -> None:
        payload = _LEN.pack(step) + params.tobytes()
        alive = []
        for wid, conn in self._followers:
            try:
                self.lan_bytes += _send(conn, payload)
                alive.append((wid, conn))
            except OSError as err:
                log.warning("site_follower_dropped", worker=wid, error=str(err))
                conn.close()
        self._followers = alive
        self._sync_ids()

    def close(self) -> None:
        """Stop accepting and close every connection; returns once the port is free again (the
        accept loop's wait holds the listening socket until it wakes)."""
        self._stop.set()
        self._server.close()
        with self._lock:
            conns = [c for _, c in self._followers] + list(self._pending.values())
        for conn in conns:
            conn.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)


def open_hub(address: str, expected_followers: int, numel: int, security: HubSecurity,
             sizes: list[int] | None = None, port_file: str | None = None) -> SiteHub:
    """The leader's hub on ``address``; with ``port_file``, on the port that file names while it is
    free (a restarted leader stays where its followers look for it), and the port bound is written
    to the file for the followers to read."""
    previous = read_port_file(port_file) if port_file else None
    if previous is not None:
        host = address.rsplit(":", 1)[0]
        try:
            hub = SiteHub(f"{host}:{previous}", expected_followers, numel, security, sizes=sizes)
        except OSError:
            log.warning("site_hub_port_taken", site=security.site, port=previous)
        else:
            write_port_file(port_file, hub.port)
            return hub
    hub = SiteHub(address, expected_followers, numel, security, sizes=sizes)
    if port_file:
        write_port_file(port_file, hub.port)
    return hub


class SiteLink:
    """A follower's side: proves it is a worker of the site, sends gradients, receives parameters."""

    def __init__(self, address: str, site_rank: int, numel: int, security: LinkSecurity,
                 timeout_s: float = CONNECT_TIMEOUT_S, params: int = 0, port_file: str | None = None):
        """Raises `AuthError` with the leader's reason when the leader refuses this worker.
        ``params``: how many parameters each gradient carries a presence flag for (the hub's ``sizes``).
        ``port_file``: the leader's port is the one this file names (read again at each try), not
        ``address``'s."""
        host, port = address.rsplit(":", 1)
        self.numel = numel
        self.params = params
        deadline = time.monotonic() + timeout_s
        while True:
            if port_file is not None:
                port = read_port_file(port_file) or 0
                address = f"{host}:{port}"
            try:
                if port_file is not None and not int(port):
                    raise ConnectionRefusedError(f"{port_file} names no port yet")
                sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError:
                if time.monotonic() > deadline:
                    where = f"the port in {port_file}" if port_file is not None and not int(port) else address
                    raise ConnectionError(f"site leader at {where} did not answer within {timeout_s:.0f} s") from None
                time.sleep(0.1)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = security.wrap(sock)
            self.lan_bytes = _send(self.sock, json.dumps({"site_rank": site_rank, "token": security.token()}).encode())
            verdict = _recv(self.sock, HELLO_MAX_BYTES, deadline=time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except BaseException:
            sock.close()
            raise
        try:
            answer = json.loads(verdict)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("ok") is not True:
            self.sock.close()
            reason = answer.get("error") if isinstance(answer, dict) else None
            raise AuthError(f"site leader at {address} refused this worker: {reason or 'malformed verdict'}")
        self.sock.settimeout(STEP_TIMEOUT_S)

    def receive(self) -> tuple[int, np.ndarray]:
        """(step, parameters) from the leader."""
        frame = _recv(self.sock, _LEN.size + self.numel * DTYPE.itemsize)
        (step,) = _LEN.unpack_from(frame)
        params = np.frombuffer(frame, dtype=DTYPE, offset=_LEN.size)
        if params.size != self.numel:
            raise ProtocolError(f"site leader sent {params.size} parameter values, expected {self.numel}")
        self.lan_bytes += _LEN.size + len(frame)
        return step, params

    def send(self, grads: np.ndarray, present: np.ndarray | None = None) -> None:
        """Send this step's gradient; ``present``: one flag per parameter (all set when None)."""
        flags = np.ones(self.params, np.uint8) if present is None else np.asarray(present, dtype=np.uint8)
        if flags.size != self.params:
            raise ValueError(f"{flags.size} presence flags for {self.params} parameters")
        payload = grads.astype(DTYPE, copy=False).tobytes() + flags.tobytes()
        self.sock.settimeout(frame_deadline(len(payload)))
        self.lan_bytes += _send(self.sock, payload)

    def close(self) -> None:
        self.sock.close()
