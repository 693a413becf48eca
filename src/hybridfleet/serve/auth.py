"""Who may call `hfleet serve`: a registry token whose principal may read the model.

The bearer header is parsed as strictly as the registry server parses it
(`hybridfleet.registry.auth.parse_bearer`); the token is checked against the registry
(its principal needs ``reader`` on the model) and the answer is kept for ``ttl_s``, so a
revoked token stops working within that time and a request costs no registry call.

The answers are kept by the exact header value (a strict parse makes header and token one
to one), so a request with a known token costs one dict lookup: no parse and no hash on
the per-request path. An answer past its time is dropped when the next one is kept.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from hybridfleet.errors import AuthError, PermissionDeniedError, RegistryNotFoundError
from hybridfleet.registry.auth import parse_bearer

CACHE_TTL_S = 5.0
CACHE_MAX = 4096


class TokenGate:
    """``check(header)`` raises AuthError / PermissionDeniedError unless the token may read the model."""

    def __init__(self, check_token: Callable[[str], None], ttl_s: float = CACHE_TTL_S):
        self._check_token = check_token
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, Exception | None]] = {}  # header -> (expiry, the refusal or None)
        self._lock = threading.Lock()

    def cached_refusal(self, header: str | None) -> Exception | None | bool:
        """Without a registry call: the error `check` would raise for ``header``, None when it would pass,
        or False when the answer is not known (then call `check`)."""
        hit = self._cache.get(header) if header is not None else None  # a dict read is atomic: no lock
        if hit is not None and hit[0] >= time.monotonic():
            return hit[1]
        try:
            parse_bearer(header)
        except AuthError as err:
            return err
        return False

    def check(self, header: str | None) -> None:
        refusal = self.cached_refusal(header)
        if refusal is False:  # the header parses (else its AuthError came back) and its answer is not known
            token = parse_bearer(header)
            try:
                self._check_token(token)
                refusal = None
            except (AuthError, PermissionDeniedError) as err:
                refusal = err
            self._keep(f"Bearer {token}", refusal)  # the header itself: the parse is strict
        if refusal is not None:
            raise refusal

    def _keep(self, header: str, refusal: Exception | None) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._cache) >= 16:  # drop answers past their time (few tokens call a server: this is short)
                for stale in [h for h, (expiry, _) in self._cache.items() if expiry < now]:
                    del self._cache[stale]
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[header] = (now + self.ttl_s, refusal)


def registry_reader_check(reg: Any, full_name: str) -> Callable[[str], None]:
    """A token check: the token's principal (in ``reg``) holds reader on ``full_name``."""
    namespace, name = full_name.split("/", 1)

    def check(token: str) -> None:
        try:
            if hasattr(reg, "for_token"):  # a local registry database
                reg.for_token(token).actor.require("reader", namespace, name, "call the model's inference server")
            else:  # a registry server: ask it as that principal
                from hybridfleet.registry.client import RemoteRegistry

                RemoteRegistry(reg.url, token).get_version(full_name)
        except RegistryNotFoundError:  # the registry hides a model from a principal without reader on it
            raise PermissionDeniedError(f"this token's principal needs role 'reader' on {full_name} "
                                        f"to call the model's inference server") from None

    return check
