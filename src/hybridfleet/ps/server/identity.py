"""Binding a request to the identity that sent it.

A request names a worker (``worker_id``); the caller's verified token names the one
worker it belongs to (``wid``) and its site, and with mutual TLS the client
certificate names the site too. A request is served only when all of them agree, so
a worker cannot act as another worker, a site as another site, nor any other role
(an admin, a monitor, a shard) as a worker.
"""

from __future__ import annotations

from hybridfleet.ps.wire.reject import Reject
from hybridfleet.security.tokens import WORKER_ROLE


def bind_worker(worker_id: str, claims, peer_site: str | None) -> str:
    """The identity ``worker_id`` acts as, after checking the caller may act as it; Reject otherwise.

    ``claims``: the verified token (None when the shard runs without auth, explicitly);
    ``peer_site``: the common name of the client certificate (None without mutual TLS).
    """
    if not worker_id:
        raise Reject("INVALID_ARGUMENT", "the request names no worker_id")
    if claims is None:
        return worker_id
    if peer_site is not None and peer_site != claims.site:
        raise Reject("PERMISSION_DENIED", f"client certificate is for site {peer_site!r}, the token for site "
                                          f"{claims.site!r}")
    if claims.role != WORKER_ROLE:
        raise Reject("PERMISSION_DENIED", f"a token of role {claims.role!r} cannot act as a worker")
    if claims.worker is None:
        raise Reject("PERMISSION_DENIED", "token names no worker (claim 'wid'); issue one token per worker "
                                          "(`hfleet certs token --worker SITE-RANK`)")
    if claims.worker != worker_id:
        raise Reject("PERMISSION_DENIED", f"token is for worker {claims.worker!r}; the request names worker "
                                          f"{worker_id!r}")
    return worker_id


def grpc_peer_site(context) -> str | None:
    """The common name of the gRPC caller's verified client certificate (mutual TLS), else None."""
    try:
        names = context.auth_context().get("x509_common_name")
    except Exception:  # noqa: BLE001 - a context without auth data (plaintext) has no certificate
        return None
    return names[0].decode("utf-8", "replace") if names else None


def tls_peer_site(conn) -> str | None:
    """The common name of a TLS socket's verified client certificate, else None."""
    getpeercert = getattr(conn, "getpeercert", None)
    cert = getpeercert() if getpeercert is not None else None
    for rdn in (cert or {}).get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return None
