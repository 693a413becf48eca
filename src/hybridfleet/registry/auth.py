"""Who may do what: principals (users, service accounts) with tokens, and roles per scope.

Roles are ordered: reader < writer < releaser < admin; a role includes those below it.
A grant's scope is ``*`` (everything), a namespace, or one model ``NAMESPACE/NAME``; a
principal's role on a model is the highest of its grants on these three. Creating a
model gives its creator no role (MLflow's automatic MANAGE is what users asked us to
avoid): an admin grants roles explicitly.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from hybridfleet.errors import AuthError, PermissionDeniedError, RegistryError, RegistryNotFoundError

ROLES = ("reader", "writer", "releaser", "admin")
KINDS = ("user", "service")
TOKEN_PREFIX = "hfr_"
LOCAL_OWNER = "local-owner"  # direct database access without a token: whoever can open the DB owns it
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@\-]{0,127}")  # fullmatch: no trailing newline


def check_role(role: str) -> str:
    if role not in ROLES:
        raise RegistryError(f"role must be one of {', '.join(ROLES)} (got {role!r})")
    return role


def check_principal_name(name: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise RegistryError(f"principal name {name!r}: letters, digits and _ . @ - only, up to 128 characters")
    return name


# A bearer token as the HTTP spec's token68 allows and ours are made: visible ASCII, no space.
_BEARER_TOKEN = re.compile(r"[\x21-\x7e]{1,512}")


def parse_bearer(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or AuthError.

    Strict: one scheme, one space, one token of visible ASCII. Anything else (no header,
    another scheme, an empty or whitespace-only token, Unicode spaces, two tokens) is
    refused, never read as "no token": a network caller always names a principal.
    """
    if header is None or not header.startswith("Bearer "):
        raise AuthError("missing token: send Authorization: Bearer <token>")
    token = header[len("Bearer "):]
    if not _BEARER_TOKEN.fullmatch(token):
        raise AuthError("malformed bearer token: send Authorization: Bearer <token> (one token of visible ASCII)")
    return token


_TTL = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_TTL_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_TTL_S = 3650 * 86400


def parse_ttl(text: str | None) -> float | None:
    """Seconds of a token lifetime ``30d``, ``12h``, ``45m``, ``600s`` (None or ``never``: no expiry)."""
    if text is None or text == "never":
        return None
    match = _TTL.fullmatch(text)
    if not match:
        raise RegistryError(f"ttl {text!r}: a number and a unit, e.g. 30d, 12h, 45m, 600s (or never)")
    seconds = int(match.group(1)) * _TTL_UNIT_S[match.group(2)]
    if seconds > MAX_TTL_S:
        raise RegistryError(f"ttl {text!r}: at most 3650d")
    return float(seconds)


def new_token() -> tuple[str, str]:
    """(token shown once to the user, sha256 kept in the database)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, token_digest(token)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def not_found_message(namespace: str, name: str) -> str:
    """The one answer for a model that does not exist and for one the caller may not see."""
    return f"no model {namespace}/{name} in this registry (or no permission to see it)"


def scopes_of(namespace: str, name: str | None) -> list[str]:
    """The grant scopes that cover a model (or, with ``name`` None, a namespace)."""
    return ["*", namespace] + ([f"{namespace}/{name}"] if name else [])


@dataclass(frozen=True)
class Actor:
    """The caller of a registry operation and its grants (scope -> role)."""

    name: str
    grants: dict[str, str]
    owner: bool = False  # local database access without a token
    expires_s: float | None = None  # the token's expiry (UNIX seconds; None: none)

    def role_on(self, namespace: str, name: str | None) -> str | None:
        """The highest role this actor holds on the model (or namespace)."""
        if self.owner:
            return "admin"
        held = [self.grants[s] for s in scopes_of(namespace, name) if s in self.grants]
        return max(held, key=ROLES.index) if held else None

    def require(self, role: str, namespace: str, name: str | None, action: str, conceal: bool = True) -> None:
        """PermissionDeniedError naming the missing role unless the actor holds ``role`` or above.

        On a model the actor holds no role on at all, the answer is the one a missing model
        gets (RegistryNotFoundError, `not_found_message`): a caller without a role cannot
        tell which models exist. A caller with some role (it may read the model) learns
        which role it lacks. ``conceal`` False: always the PermissionDeniedError (for an
        action whose answer is the same whether the model exists or not, such as creating it).
        """
        have = self.role_on(namespace, name)
        if have is not None and ROLES.index(have) >= ROLES.index(role):
            return
        if have is None and name is not None and conceal:
            raise RegistryNotFoundError(not_found_message(namespace, name))
        target = f"{namespace}/{name}" if name else f"namespace {namespace}"
        raise PermissionDeniedError(
            f"permission denied: {self.name} needs role '{role}' on {target} to {action} (has: {have or 'no role'})")
