"""TLS for the bulk data plane: OpenSSL's record loop in C when built, Python's ssl module otherwise.

Why: Python's ``SSLSocket.recv_into`` returns at most one TLS record (16 KiB), so
reading a 64 MB frame takes ~4,000 interpreter round trips, each taking the GIL
back and doing two read syscalls; on the PS benchmark that made TLS ~2x slower
than plaintext although AES-GCM itself runs at several GB/s per core here.
Options weighed (bench/ps_exchange.py measures the chosen one against both anchors):

- **C extension against OpenSSL** (`hybridfleet.ps.wire._tls`, chosen): after
  ``connect``/``accept`` it owns the socket, runs the standard TLS 1.3 handshake
  with the same certificate, key and CA files and the same checks (chain, host
  name or IP address, client certificate for mutual TLS), then reads a whole frame
  into the caller's buffer (``recv_exact_into``) and writes a whole buffer
  (``sendall``) in one call each with the GIL released, reading records through a
  buffer that one syscall fills with many of them and writing them into a buffer
  that one syscall sends. Same exceptions as the ssl module
  (``ssl.SSLCertVerificationError`` with ``CERTIFICATE_VERIFY_FAILED`` ...,
  ``TimeoutError``, ``OSError``, ``EOFError`` for a stream cut mid-frame), so the
  bulk plane maps them to the same error codes.
  Measured tuning: fetching up to 256 KiB of records per ``recv`` cut receive CPU by
  ~25% against two reads per record; done by OpenSSL's read-ahead it also moved the
  rest of the buffer before every record (OpenSSL 3.0), so the connection's own reader
  BIO does it, which halved what TLS adds on the receiving side again (docs/SCALE.md,
  "TLS at the cipher's cost"). Writing records into a 256 KiB BIO pair and sending
  them ~16 at a time instead of one ``send`` per record cut another ~20% on both
  ends, where corking one-record writes (TCP_CORK) had changed nothing. What is left
  per byte is OpenSSL's AES-GCM, its copies into and out of its record buffer, one
  copy through each of the two buffers and the kernel's socket copies; on the shard
  the bigger win is that a whole frame moves without the GIL, so two workers'
  connections no longer queue for it.
- **Kernel TLS** (``ssl.OP_ENABLE_KTLS``, Python 3.12+): needs the kernel's ``tls``
  module (``CONFIG_TLS``); absent on the machines this was measured on, so not used.
- **Rust (rustls via PyO3)**: would need crates from crates.io at build time,
  which installs cannot count on; OpenSSL's headers are one Debian package.

The native connection is configured from the Python ``ssl.SSLContext`` (options,
protocol versions, verify mode and flags, host-name rules, TLS 1.2 ciphers, its
``keylog_filename``) plus the files it was loaded from, which the context builders
record with `remember_files`. A context without recorded files, a missing extension,
or ``HFLEET_NATIVE_TLS=0`` in the environment selects the ssl module.

**Sealed records.** OpenSSL copies every byte into its record buffer to seal it and
opens records in that buffer before copying them out (no call seals from or opens into
the caller's buffer); those copies cost as much again as the cipher. When both ends
are native connections they agree, by ALPN (``hfleet-sealed/1``) in the TLS 1.3
handshake, to carry the bytes after it in sealed records instead: AES-256-GCM under
keys from TLS 1.3's exporter (RFC 8446 7.5; DTLS-SRTP keys media from DTLS the same
way), a record's body received straight into the caller's frame and opened there,
sealed from the caller's bytes into the buffer it is sent from (format, nonces, key
changes and failure rules: "Sealed records" in ``_tls.c``; tests:
tests/test_ps_tls_sealed.py, against the exporter and AES-GCM computed independently).
The handshake, its certificate and host-name checks and the tokens are unchanged. A
peer on Python's ssl module offers no ALPN, so the pair keeps TLS records and either
side may still use either path; ``HFLEET_SEALED_RECORDS=0`` keeps TLS records between
native ends too. `records` says which a connection uses.
"""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any

from hybridfleet.switches import switched_on

try:  # the C extension built from _tls.c, when OpenSSL's headers were there at install time
    from hybridfleet.ps.wire import _tls
except ImportError:  # pragma: no cover - depends on the install
    _tls = None

ENV_SWITCH = "HFLEET_NATIVE_TLS"
SEALED_SWITCH = "HFLEET_SEALED_RECORDS"
_FILES_ATTR = "_hfleet_tls_files"
_NATIVE_ATTR = "_hfleet_native_context"


def native_available() -> bool:
    """True when the C extension is built and ``HFLEET_NATIVE_TLS`` does not switch it off."""
    return _tls is not None and switched_on(ENV_SWITCH)


def sealed_records_wanted() -> bool:
    """True unless ``HFLEET_SEALED_RECORDS`` switches sealed records off (see `wrap`)."""
    return switched_on(SEALED_SWITCH)


def records_between_native_ends() -> str:
    """What this environment's bulk connections use between two of its own ends: ``"sealed"``, or
    ``"tls"`` without the extension or with ``HFLEET_NATIVE_TLS=0`` / ``HFLEET_SEALED_RECORDS=0``."""
    return "sealed" if native_available() and sealed_records_wanted() else "tls"


def records(conn: Any) -> str:
    """How ``conn``'s bytes travel after its handshake: ``"sealed"`` (the native path's sealed records),
    ``"tls"`` (TLS records) or ``"plaintext"`` (no TLS)."""
    if isinstance(conn, ssl.SSLSocket):
        return "tls"
    layer = getattr(conn, "records", None)
    return layer()[0] if layer is not None else "plaintext"


def native_openssl_version() -> str | None:
    """The OpenSSL the C extension was built against (``OpenSSL 3.0.19 27 Jan 2026``), None when not built."""
    return _tls.OPENSSL_VERSION if _tls is not None else None


def native_seal_open(total_bytes: int, record_bytes: int = 16 << 10) -> bool:
    """Seal then open ``total_bytes`` with AES-256-GCM in ``record_bytes`` records in the C extension's
    OpenSSL, the cipher its connections run (what it costs by itself, for benchmarks: fixed key and
    nonce, nothing kept). False, having done nothing, when the extension is not built; ValueError
    for a negative total or a record outside 1 byte .. 1 MiB."""
    if _tls is None:
        return False
    _tls.seal_open(total_bytes, record_bytes)
    return True


def remember_files(ctx: ssl.SSLContext, *, certfile: str | None = None, keyfile: str | None = None,
                   cafile: str | None = None) -> ssl.SSLContext:
    """Record the files ``ctx`` was loaded from so native connections load the same ones; returns ``ctx``."""
    setattr(ctx, _FILES_ATTR, (certfile, keyfile, cafile))
    return ctx


def _native_context(ctx: ssl.SSLContext, server_side: bool):
    """The extension's context mirroring ``ctx`` (cached on it while its settings stay the same), or None."""
    files = getattr(ctx, _FILES_ATTR, None)
    if files is None or _tls is None:
        return None
    ciphers = ":".join(c["name"] for c in ctx.get_ciphers() if c["protocol"] != "TLSv1.3")
    settings = (server_side, *files, int(ctx.verify_mode), ctx.check_hostname, ctx.hostname_checks_common_name,
                int(ctx.options), int(ctx.minimum_version), int(ctx.maximum_version), int(ctx.verify_flags), ciphers,
                sealed_records_wanted(), ctx.keylog_filename)
    cached = getattr(ctx, _NATIVE_ATTR, None)
    if cached is not None and cached[0] == settings:
        return cached[1]
    certfile, keyfile, cafile = files
    native = _tls.Context(server_side, cafile, certfile, keyfile, *settings[4:])
    setattr(ctx, _NATIVE_ATTR, (settings, native))
    return native


def wrap(ctx: ssl.SSLContext, sock: socket.socket, *, server_side: bool, server_hostname: str | None = None,
         native: bool | None = None) -> "TLSConnection | ssl.SSLSocket":
    """TLS over the connected ``sock``, handshake done within ``sock``'s timeout.

    Returns a `TLSConnection` (which then owns the socket) when the native path is
    available for ``ctx`` and wanted (``native``; None: unless ``HFLEET_NATIVE_TLS=0``),
    else ``ctx.wrap_socket(sock, ...)``. Either raises what the ssl module raises for a
    failed handshake.
    """
    wanted = native_available() if native is None else native
    native_ctx = _native_context(ctx, server_side) if wanted else None
    if native_ctx is None:
        return ctx.wrap_socket(sock, server_side=server_side, server_hostname=server_hostname)
    timeout = sock.gettimeout()
    fd = sock.detach()
    try:
        conn = TLSConnection(native_ctx, fd, None if server_side else server_hostname)
    except BaseException:
        os.close(fd)
        raise
    try:
        conn.settimeout(timeout)
        conn.do_handshake()
    except BaseException:
        conn.close()
        raise
    return conn


def wrap_nonblocking(ctx: ssl.SSLContext, sock: socket.socket, *, native: bool | None = None
                     ) -> "TLSConnection | ssl.SSLSocket":
    """Server-side TLS over the accepted ``sock`` in non-blocking mode, handshake not started:
    drive it with `handshake_step` when the socket is ready. Same choice of path as `wrap`; the
    connection never waits (a read that would wait raises ``TimeoutError`` on the native path,
    ``ssl.SSLWantReadError`` on the ssl module's) until given a timeout with ``settimeout``."""
    wanted = native_available() if native is None else native
    native_ctx = _native_context(ctx, True) if wanted else None
    if native_ctx is None:
        sock.setblocking(False)
        return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    fd = sock.detach()
    try:
        conn = TLSConnection(native_ctx, fd, None)
    except BaseException:
        os.close(fd)
        raise
    conn.settimeout(0.0)  # every wait for the peer ends at once: the caller's event loop waits instead
    return conn


def handshake_step(conn: "TLSConnection | ssl.SSLSocket") -> str | None:
    """Advance the handshake of a `wrap_nonblocking` connection: None once it is complete, else what
    it waits for, ``"read"`` or ``"write"``; raises what `wrap` raises for a failed handshake.

    The native path cannot tell the two waits apart and says ``"read"``: the server's handshake
    flight is a few KiB, which a fresh socket's send buffer always takes, so it only ever waits
    for the client."""
    try:
        conn.do_handshake()
    except ssl.SSLWantWriteError:
        return "write"
    except (ssl.SSLWantReadError, TimeoutError):
        return "read"
    return None


if _tls is not None:
    class TLSConnection(_tls.Connection):
        """A TLS connection whose reads and writes run in C; the socket surface the bulk plane uses.

        ``recv_exact_into(buf, deadline=None)`` and ``sendall(data, deadline=None)``
        move a whole frame per call; ``settimeout`` bounds each wait for progress and
        ``deadline`` (a ``time.monotonic()`` value) the whole call. ``recv``,
        ``recv_into``, ``shutdown``, ``close``, ``fileno`` and ``getpeercert`` behave as
        an ``ssl.SSLSocket``'s do.
        """

        def getpeercert(self, binary_form: bool = False) -> dict[str, Any] | bytes | None:
            """The verified peer certificate: DER with ``binary_form``, else the dict ``ssl`` returns."""
            der = self.peer_certificate()
            if der is None or binary_form:
                return der
            return _cert_dict(der)

        def __enter__(self) -> "TLSConnection":
            return self

        def __exit__(self, *exc) -> None:
            self.close()
else:  # pragma: no cover - depends on the install
    TLSConnection = None  # type: ignore[assignment,misc]


def _even_hex(n: int) -> str:
    digits = f"{n:X}"
    return "0" * (len(digits) % 2) + digits  # whole bytes, as OpenSSL prints serial numbers


def _cert_dict(der: bytes) -> dict[str, Any]:
    """``ssl.SSLSocket.getpeercert()``'s dict for a DER certificate (subject, issuer, dates, SANs)."""
    from cryptography import x509

    cert = x509.load_der_x509_certificate(der)

    def name(n: x509.Name) -> tuple:
        return tuple(tuple((getattr(a.oid, "_name", a.oid.dotted_string), str(a.value)) for a in rdn) for rdn in n.rdns)

    def when(t) -> str:  # OpenSSL's "Jan  5 09:34:43 2038 GMT"
        return f"{t:%b} {t.day:2d} {t:%H:%M:%S %Y} GMT"

    out: dict[str, Any] = {
        "subject": name(cert.subject), "issuer": name(cert.issuer), "version": cert.version.value + 1,
        "serialNumber": _even_hex(cert.serial_number),
        "notBefore": when(cert.not_valid_before_utc), "notAfter": when(cert.not_valid_after_utc),
    }
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return out
    kinds = {x509.DNSName: "DNS", x509.IPAddress: "IP Address", x509.RFC822Name: "email",
             x509.UniformResourceIdentifier: "URI"}
    out["subjectAltName"] = tuple((kinds[type(g)], str(g.value)) for g in sans if type(g) in kinds)
    return out
