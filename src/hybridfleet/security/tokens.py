"""Signed bearer tokens: who may call the parameter server, for which job, until when.

Tokens are JWTs signed with Ed25519 (``alg: EdDSA``): the private key issues,
the public key only verifies, so shards and workers can hold the public key
without being able to mint tokens. Claims::

    job   the job the token is valid for (a server rejects other jobs' tokens)
    site  the site of the caller (e.g. "hospital", "cloud")
    role  what the caller is (e.g. "worker", "shard", "admin"); servers map RPCs to roles
    wid   the worker the token belongs to, e.g. "hospital-0"; a shard refuses a worker token
          without it, and any request of this token that names another worker
    jti   the token's unique id (a revocation list names tokens by it)
    sub   optional subject, e.g. "hospital/worker-0"
    iat, exp  issue and expiry time, unix seconds

The verifier allows a clock leeway (`DEFAULT_LEEWAY_S`, 5 s) on expiry and
issue time, so peers whose clocks differ by a few seconds still agree.
Every rejection is a `TokenRejectedError` (an `AuthError`) whose message says
exactly why; its ``reason`` lets the gRPC layer choose a status code.
A verifier given a `RevocationList` also refuses every revoked ``jti``.
"""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hybridfleet.errors import AuthError
from hybridfleet.security.certs import CERT_FILE_MODE, KEY_FILE_MODE, write_file_atomic

ALGORITHM = "EdDSA"
SIGNING_KEY = "token-signing.key"
VERIFY_KEY = "token-signing.pub"
DEFAULT_LEEWAY_S = 5.0
_REQUIRED_CLAIMS = ("job", "site", "role", "exp", "jti")
# The role of tokens that act as a worker (a shard requires their ``wid``).
WORKER_ROLE = "worker"


class TokenRejectedError(AuthError):
    """A token was refused; ``reason`` is one of `REASONS`."""

    REASONS = ("missing", "malformed", "forged", "expired", "not_yet_valid", "wrong_job", "role", "revoked")

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Claims:
    """The verified content of a token."""

    job: str
    site: str
    role: str
    subject: str | None
    issued_at: dt.datetime | None
    expires_at: dt.datetime
    worker: str | None = None   # the ``wid`` claim: the only worker id this token may act as
    token_id: str = ""          # the ``jti`` claim


def generate_signing_key(directory: str | os.PathLike[str], overwrite: bool = False) -> tuple[Path, Path]:
    """Create an Ed25519 key pair in ``directory``: (private key 0600, public key), both PEM.

    Without ``overwrite`` an existing key is an `AuthError` and nothing is written.
    """
    root = Path(directory)
    priv_path, pub_path = root / SIGNING_KEY, root / VERIFY_KEY
    existing = [str(p) for p in (priv_path, pub_path) if p.exists()]
    if existing and not overwrite:
        raise AuthError(f"refusing to overwrite {', '.join(existing)}; pass overwrite (CLI: --force) to replace it")
    key = Ed25519PrivateKey.generate()
    root.mkdir(parents=True, exist_ok=True)
    write_file_atomic(
        priv_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        KEY_FILE_MODE,
    )
    write_file_atomic(
        pub_path,
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        CERT_FILE_MODE,
    )
    return priv_path, pub_path


def _as_bytes(pem: bytes | str) -> bytes:
    return pem.encode() if isinstance(pem, str) else pem


def _read_key_file(directory: str | os.PathLike[str], name: str) -> bytes:
    path = Path(directory) / name
    if not path.is_file():
        raise AuthError(f"token key {path} does not exist; create it with `hfleet certs init {directory}`",
                        hint=f"pass the directory `hfleet certs init` wrote (it holds {path.name}), "
                             f"or create one with `hfleet certs init {directory}`")
    return path.read_bytes()


def _check_text(field: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field}: must be a non-empty string (got {value!r})")
    return value


def _utc(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc)


class TokenIssuer:
    """Issues tokens; only the holder of the Ed25519 private key can."""

    def __init__(self, private_key_pem: bytes | str, clock: Callable[[], float] = time.time):
        try:
            key = serialization.load_pem_private_key(_as_bytes(private_key_pem), password=None)
        except (ValueError, TypeError) as err:
            raise ValueError(f"private_key_pem: not an unencrypted PEM private key ({err})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"private_key_pem: tokens are signed with Ed25519, not {type(key).__name__}")
        self._key = key
        self._clock = clock

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> "TokenIssuer":
        """The issuer of the signing key made by `generate_signing_key` in ``directory``."""
        return cls(_read_key_file(directory, SIGNING_KEY))

    def issue(self, job: str, site: str, role: str, ttl_s: float, subject: str | None = None,
              worker: str | None = None) -> str:
        """A token for ``job``/``site``/``role`` that expires ``ttl_s`` seconds from now, with a fresh
        ``jti``; ``worker`` binds it to one worker id (a shard refuses worker tokens without one, see
        `hybridfleet.security.credentials`)."""
        claims: dict[str, object] = {
            "job": _check_text("job", job),
            "site": _check_text("site", site),
            "role": _check_text("role", role),
            "jti": uuid.uuid4().hex,
        }
        if worker is not None:
            claims["wid"] = _check_text("worker", worker)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"ttl_s: must be a number of seconds > 0 (got {ttl_s!r})")
        if subject is not None:
            claims["sub"] = _check_text("subject", subject)
        now = self._clock()
        claims["iat"] = int(now)
        claims["exp"] = int(now + ttl_s)
        return jwt.encode(claims, self._key, algorithm=ALGORITHM)


class TokenVerifier:
    """Verifies tokens of one job with the issuer's public key."""

    def __init__(
        self,
        public_key_pem: bytes | str,
        job: str,
        leeway_s: float = DEFAULT_LEEWAY_S,
        clock: Callable[[], float] = time.time,
        revoked: "RevocationList | None" = None,
    ):
        try:
            key = serialization.load_pem_public_key(_as_bytes(public_key_pem))
        except (ValueError, TypeError) as err:
            raise ValueError(f"public_key_pem: not a PEM public key ({err})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"public_key_pem: tokens are verified with Ed25519, not {type(key).__name__}")
        if leeway_s < 0:
            raise ValueError(f"leeway_s: must be >= 0 (got {leeway_s})")
        self._key = key
        self.job = _check_text("job", job)
        self.leeway_s = leeway_s
        self._clock = clock
        self.revoked = revoked

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], job: str, leeway_s: float = DEFAULT_LEEWAY_S) -> "TokenVerifier":
        """The verifier of the public key made by `generate_signing_key` in ``directory``; it honours
        the revocation list ``directory/revoked-tokens`` (re-read when it changes)."""
        return cls(_read_key_file(directory, VERIFY_KEY), job, leeway_s=leeway_s,
                   revoked=RevocationList(Path(directory) / REVOKED_FILE))

    def verify(self, token: str | None, roles: Iterable[str] | None = None) -> Claims:
        """The claims of ``token`` if it is signed by the issuer, unexpired, for this job and,
        when ``roles`` is given, for one of those roles; else `TokenRejectedError` saying why."""
        if not token:
            raise TokenRejectedError("missing", "missing token: the call carries no bearer token")
        payload = self._decode(token)
        now = self._clock()
        exp, iat = payload["exp"], payload.get("iat")
        if now > exp + self.leeway_s:
            raise TokenRejectedError(
                "expired",
                f"token expired {now - exp:.0f} s ago (at {_utc(exp).isoformat()}; leeway {self.leeway_s:g} s)",
            )
        if iat is not None and iat > now + self.leeway_s:
            raise TokenRejectedError(
                "not_yet_valid",
                f"token issued {iat - now:.0f} s in the future; the issuer's clock is ahead of this one",
            )
        if payload["job"] != self.job:
            raise TokenRejectedError(
                "wrong_job", f"token is for job {payload['job']!r}, this server serves job {self.job!r}"
            )
        if self.revoked is not None and payload["jti"] in self.revoked:
            raise TokenRejectedError("revoked", f"token {payload['jti']} has been revoked")
        if roles is not None:
            allowed = sorted(set(roles))
            if payload["role"] not in allowed:
                raise TokenRejectedError(
                    "role",
                    f"role {payload['role']!r} is not allowed for this call "
                    f"(allowed: {', '.join(repr(r) for r in allowed) or 'none'})",
                )
        return Claims(
            job=payload["job"],
            site=payload["site"],
            role=payload["role"],
            subject=payload.get("sub"),
            issued_at=_utc(iat) if iat is not None else None,
            expires_at=_utc(exp),
            worker=payload.get("wid"),
            token_id=payload["jti"],
        )

    def _decode(self, token: str) -> dict:
        # Time claims are checked in `verify` against our own clock (testable, one message style);
        # PyJWT checks the signature, the algorithm and that the required claims are present.
        try:
            payload = jwt.decode(
                token,
                self._key,
                algorithms=[ALGORITHM],
                options={"verify_exp": False, "verify_iat": False, "verify_nbf": False, "require": list(_REQUIRED_CLAIMS)},
            )
        except jwt.InvalidSignatureError:
            raise TokenRejectedError(
                "forged", "token signature is invalid: it was not signed by this job's token key (forged or from another job)"
            ) from None
        except jwt.InvalidAlgorithmError:
            alg = _unverified_alg(token)
            raise TokenRejectedError(
                "forged", f"token is signed with algorithm {alg!r}; only {ALGORITHM!r} is accepted"
            ) from None
        except jwt.MissingRequiredClaimError as err:
            raise TokenRejectedError("malformed", f"malformed token: it lacks the {err.claim!r} claim") from None
        except jwt.InvalidTokenError as err:
            raise TokenRejectedError("malformed", f"malformed token: {err}") from None
        for name in ("job", "site", "role", "sub", "wid", "jti"):
            if name in payload and (not isinstance(payload[name], str) or not payload[name]):
                raise TokenRejectedError("malformed", f"malformed token: claim {name!r} must be a non-empty string")
        for name in ("exp", "iat"):
            if name in payload and (isinstance(payload[name], bool) or not isinstance(payload[name], (int, float))):
                raise TokenRejectedError("malformed", f"malformed token: claim {name!r} must be a unix time in seconds")
        return payload


def unverified_claims(token: str) -> dict:
    """The claims of ``token`` WITHOUT checking its signature: for the issuer's own bookkeeping
    (its ``jti`` and expiry) and for display, never for a decision."""
    try:
        return jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError as err:
        raise TokenRejectedError("malformed", f"malformed token: {err}") from None


def _unverified_alg(token: str) -> str:
    try:
        return str(jwt.get_unverified_header(token).get("alg"))
    except jwt.InvalidTokenError:
        return "unknown"


REVOKED_FILE = "revoked-tokens"
REVOCATION_RECHECK_S = 1.0


class RevocationList:
    """The ``jti`` values a shard refuses, read from a text file (one id per line, ``#`` comments).

    The file is re-read when its size or modification time changes (looked at no more than
    once per `REVOCATION_RECHECK_S`), so revoking a token needs no restart. A missing file
    revokes nothing; a file that exists but cannot be read revokes everything (fail closed).
    """

    def __init__(self, path: str | os.PathLike[str], clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self._clock = clock
        self._ids: frozenset[str] = frozenset()
        self._stamp: tuple | None = None
        self._checked = float("-inf")
        self._unreadable: str | None = None

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < REVOCATION_RECHECK_S:
            return
        self._checked = now
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._ids, self._stamp, self._unreadable = frozenset(), None, None
            return
        except OSError as err:
            self._unreadable = str(err)
            return
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if stamp == self._stamp:
            return
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            self._unreadable = str(err)
            return
        self._ids = frozenset(line.split("#", 1)[0].strip() for line in text.splitlines()) - {""}
        self._stamp, self._unreadable = stamp, None

    def __contains__(self, token_id: object) -> bool:
        self._refresh()
        if self._unreadable is not None:
            return True
        return token_id in self._ids


def revoke(directory: str | os.PathLike[str], token_ids: Iterable[str]) -> Path:
    """Add ``token_ids`` to the revocation list of the PKI in ``directory``; returns its path."""
    path = Path(directory) / REVOKED_FILE
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    have = {line.split("#", 1)[0].strip() for line in old.splitlines()}
    new = [_check_text("token id", t).strip() for t in token_ids if t.strip() not in have]
    text = old + ("" if not old or old.endswith("\n") else "\n") + "".join(f"{t}\n" for t in new)
    write_file_atomic(path, text.encode(), CERT_FILE_MODE)
    return path
