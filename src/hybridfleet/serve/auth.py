"""Who may call `hfleet serve`: a registry token whose principal may read the served model.

The bearer header is parsed as strictly as the registry server parses it
(`hybridfleet.registry.auth.parse_bearer`); the token is checked against the registry
(its principal needs ``reader`` on the model) and the answer is kept for ``ttl_s``, so a
revoked token stops working within that time and a request costs no registry call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from hybridfleet.errors import AuthError, PermissionDeniedError, RegistryNotFoundError
from hybridfleet.registry.auth import parse_bearer, token_digest

CACHE_TTL_S = 5.0
CACHE_MAX = 4096


class TokenGate:
    """``check(header)`` raises AuthError / PermissionDeniedError unless the token may read the model."""

    def __init__(self, check_token: Callable[[str], None], ttl_s: float = CACHE_TTL_S):
        self._check_token = check_token
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, Exception | None]] = {}
        self._lock = threading.Lock()

    def cached_refusal(self, header: str | None) -> Exception | None | bool:
        """Without a registry call: the error `check` would raise for ``header``, None when it would pass,
        or False when the answer is not cached (then call `check`)."""
        try:
            digest = token_digest(parse_bearer(header))
        except AuthError as err:
            return err
        with self._lock:
            hit = self._cache.get(digest)
        if hit is None or hit[0] < time.monotonic():
            return False
        return hit[1]

    def check(self, header: str | None) -> None:
        token = parse_bearer(header)
        digest = token_digest(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is None or hit[0] < now:
            try:
                self._check_token(token)
                outcome: Exception | None = None
            except (AuthError, PermissionDeniedError) as err:
                outcome = err
            with self._lock:
                if len(self._cache) >= CACHE_MAX:
                    self._cache.clear()
                self._cache[digest] = (now + self.ttl_s, outcome)
            hit = (0.0, outcome)
        if hit[1] is not None:
            raise hit[1]


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
