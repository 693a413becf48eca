"""Who may join a site's reduce: the site hub's TLS and token binding.

The hub (the site leader, site rank 0) adds every follower's gradient to the site's
sum before differential privacy and masking, and sends it the full model every step,
so it admits only workers of its own site, each proving it with its own token, the
same token and the same checks the shards use (`hybridfleet.security.tokens`):

- TLS with a server certificate for `HUB_SERVER_NAME` whose common name is the site
  (`hybridfleet.security.certs.issue_hub_certificate`); followers verify it against the
  job's CA and check the name, so neither a shard's nor another site's hub passes;
- with mutual TLS the follower shows its site's client certificate (common name = site);
- the follower's token must be a ``worker`` token of this job and this site naming a
  worker id of a follower (``<site>-<r>``, ``1 <= r < workers``) and the site rank the
  follower claims; a token of another site, of the leader itself, or of another role is
  refused with a message.

Plaintext or token-less hubs exist only where the job turned TLS or tokens off.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hybridfleet.errors import AuthError
from hybridfleet.ps.server.identity import tls_peer_site
from hybridfleet.security.certs import HUB_SERVER_NAME
from hybridfleet.security.credentials import worker_id
from hybridfleet.security.tokens import REVOKED_FILE, WORKER_ROLE, RevocationList, TokenRejectedError, \
    TokenVerifier

# Variables the leader reads; `hybridfleet.launch.psjob` sets them for ``hfleet run``.
HUB_CERT_ENV, HUB_KEY_ENV, VERIFY_KEY_ENV = "HFLEET_SITE_HUB_CERT", "HFLEET_SITE_HUB_KEY", "HFLEET_TOKEN_VERIFY_KEY"


@dataclass(frozen=True)
class HubSecurity:
    """The leader's side: the TLS context it serves with and how it checks a follower's token."""

    job: str
    site: str
    workers: int                               # the site's worker count (followers: workers - 1)
    ssl_context: ssl.SSLContext | None = None  # None: plaintext (the job turned TLS off)
    verifier: TokenVerifier | None = None      # None: no tokens (the job turned them off)
    mutual_tls: bool = False

    def follower_id(self, hello: dict, conn) -> str:
        """The worker id a follower's hello proves; `AuthError` saying why when it proves none."""
        rank = hello.get("site_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < self.workers:
            raise AuthError(f"site {self.site!r} has followers of site rank 1..{self.workers - 1}; "
                            f"the hello names site rank {rank!r}")
        wid = worker_id(self.site, rank)
        peer_site = tls_peer_site(conn)
        if self.mutual_tls and peer_site != self.site:
            raise AuthError(f"client certificate is for site {peer_site!r}, this hub serves site {self.site!r}")
        if self.verifier is None:
            return wid
        token = hello.get("token")
        try:
            claims = self.verifier.verify(token if isinstance(token, str) else None, {WORKER_ROLE})
        except TokenRejectedError as err:
            raise AuthError(str(err)) from None
        if claims.site != self.site:
            raise AuthError(f"token is for site {claims.site!r}, this hub serves site {self.site!r}")
        if claims.worker != wid:
            raise AuthError(f"token is for worker {claims.worker!r}; the hello claims worker {wid!r}")
        return wid

    @classmethod
    def from_env(cls, job, site: str, env: dict[str, str] | None = None) -> "HubSecurity":
        """The leader's security from the job (``security.tls``/``tokens``/``mutual_tls``) and
        ``HFLEET_SITE_HUB_CERT``/``_KEY``, ``HFLEET_CA_CERT`` and ``HFLEET_TOKEN_VERIFY_KEY`` (the
        revocation list ``revoked-tokens`` beside it is honoured); `AuthError` naming what is missing."""
        env = os.environ if env is None else env
        sec = job.security
        ctx = None
        if sec.tls != "off" and env.get("HFLEET_INSECURE") != "1":
            cert, key, ca = env.get(HUB_CERT_ENV), env.get(HUB_KEY_ENV), env.get("HFLEET_CA_CERT")
            if not (cert and key and ca):
                raise AuthError(f"site {site!r} aggregates with TLS on, but the leader has no hub certificate: set "
                                f"{HUB_CERT_ENV}, {HUB_KEY_ENV} and HFLEET_CA_CERT (`hfleet run` does)")
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert, key)
            if sec.mutual_tls:
                ctx.load_verify_locations(cafile=ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        verifier = None
        if sec.tokens != "off":
            pub = env.get(VERIFY_KEY_ENV)
            if not pub:
                raise AuthError(f"site {site!r} aggregates with tokens on, but the leader cannot check a follower's "
                                f"token: set {VERIFY_KEY_ENV} to the job's token-signing.pub (`hfleet run` does)")
            verifier = TokenVerifier(Path(pub).read_bytes(), job.name,
                                     revoked=RevocationList(Path(pub).parent / REVOKED_FILE))
        return cls(job.name, site, job.sites[site].workers, ctx, verifier, bool(sec.mutual_tls and ctx is not None))


@dataclass(frozen=True)
class LinkSecurity:
    """A follower's side: how it checks the hub and which token it shows."""

    site: str
    ssl_context: ssl.SSLContext | None = None  # trusts the job's CA; None: plaintext
    token: Callable[[], str | None] = lambda: None

    def wrap(self, sock):
        """``sock`` under TLS to the hub of this site (its certificate checked), or as is without TLS."""
        if self.ssl_context is None:
            return sock
        tls = self.ssl_context.wrap_socket(sock, server_hostname=HUB_SERVER_NAME)
        hub_site = tls_peer_site(tls)
        if hub_site != self.site:
            tls.close()
            raise AuthError(f"the site hub's certificate is for site {hub_site!r}, not {self.site!r}")
        return tls

    @classmethod
    def from_client(cls, site: str, security) -> "LinkSecurity":
        """From the worker's `hybridfleet.ps.worker.client.ClientSecurity` (the shards' trust and token)."""
        if not security.insecure and security.ssl_context is None:
            raise AuthError("the site hub needs TLS: set HFLEET_CA_CERT (or HFLEET_INSECURE=1 where the job "
                            "turned TLS off)")
        return cls(site, None if security.insecure else security.ssl_context, security.current_token)
