"""What a failed call to a shard means for the user: one `HfleetError` with a hint that fits.

gRPC reports a wrong certificate name, a dead address and a missing token all as
status codes with free-text details; `explain` turns them into the project's errors
(which address, since when, what to check) so no caller shows a raw `RpcError`.
"""

from __future__ import annotations

import socket
import ssl
import time

import grpc

from hybridfleet.errors import AuthError, HfleetError, UnreachableError

_NAME_MISMATCH = ("Hostname Verification Check failed", "is not in peer certificate", "Peer name")


def is_name_mismatch(err: grpc.RpcError) -> bool:
    """True when the TLS handshake failed because the certificate does not name the dialled host."""
    details = err.details() or ""
    return any(marker in details for marker in _NAME_MISMATCH)


def is_untrusted_certificate(err: grpc.RpcError) -> bool:
    """True when the TLS handshake failed because the server's certificate is not signed by our CA."""
    return "CERTIFICATE_VERIFY_FAILED" in (err.details() or "")


def certificate_names(address: str, timeout_s: float = 3.0) -> list[str]:
    """The DNS and IP names (SANs) in the certificate served at ``address`` ([] when it cannot be read)."""
    from cryptography import x509

    host, _, port = address.rpartition(":")
    try:
        pem = ssl.get_server_certificate((host, int(port)), timeout=timeout_s)
        cert = x509.load_pem_x509_certificate(pem.encode())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound, socket.timeout):
        return []
    return [str(n) for n in sans.get_values_for_type(x509.DNSName)] + [
        str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]


def explain(err: grpc.RpcError, address: str, what: str, token_given: bool = True,
            since_s: float | None = None) -> HfleetError | None:
    """The user-facing error for ``err`` from the call ``what`` to ``address``; None for other failures.

    ``since_s`` (a `time.time()` value) is when the shard first failed to answer.
    """
    code, details = err.code(), err.details() or ""
    host = address.rpartition(":")[0]
    if code == grpc.StatusCode.UNAVAILABLE and is_name_mismatch(err):
        names = certificate_names(address)
        named = ", ".join(names) if names else "names that could not be read"
        return AuthError(f"TLS: the certificate served at {address} does not name {host!r}; it names {named}",
                         hint=f"dial the shard by one of those names, or remake its certificate with "
                              f"`hfleet certs init DIR --host {host}` (one --host per name it is dialled by)")
    if code == grpc.StatusCode.UNAVAILABLE and is_untrusted_certificate(err):
        return AuthError(f"TLS: the certificate served at {address} is not signed by the CA given (--certs)",
                         hint="pass --certs with the CA the shards' certificates were made with "
                              "(the directory `hfleet certs init` wrote for this job)")
    if code == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details:
        return UnreachableError(f"{address} closed the connection during {what}: {details}",
                                hint="a shard served with TLS closes plaintext calls: drop --insecure-plaintext "
                                     "and pass --certs DIR")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        since = ""
        if since_s is not None:
            since = f" since {time.strftime('%H:%M:%S', time.localtime(since_s))} ({time.time() - since_s:.0f} s)"
        return UnreachableError(f"no shard answers {what} at {address}{since}: {details}",
                                hint=f"check that `hfleet ps serve` runs on {host or 'that host'} and listens on that "
                                     "port, and that no firewall blocks it")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        hint = None if token_given else ("pass --token or set HFLEET_TOKEN; make one with "
                                         "`hfleet certs token DIR --job JOB --site SITE --role monitor`")
        return AuthError(f"{address} refused {what}: {details}", hint=hint)
    return None
