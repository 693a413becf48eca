"""The job as it ran: the resolved spec (every default filled in) with its secrets redacted.

`hfleet run` keeps this copy as ``RUN_DIR/job.json``, so a run says exactly how it was set
up even after its job file changed or moved; `hfleet ui`'s compare page diffs these copies.
Redacted: the password of any URL (``postgresql://user:***@host/db``, ``s3://key:***@...``),
every value under a key that names a secret (token, secret, password, credential, api key,
access key), and the value of a script argument that does (``--api-token=***``, or the
argument after ``--api-token``).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hybridfleet.spec.models import JobSpec

REDACTED = "***"
_SECRET_NAME = re.compile(r"token|secret|passw(or)?d|credential|api[_-]?key|access[_-]?key", re.IGNORECASE)
# a setting that only says whether a mechanism is on, never a secret itself
_NOT_SECRET = {"tokens", "token_ttl_s"}


def _redact_url(text: str) -> str:
    if "://" not in text or "@" not in text:
        return text
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:
        return text
    if not password:
        return text
    netloc = parts.netloc.replace(f":{password}@", f":{REDACTED}@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _redact_args(args: list[Any]) -> list[Any]:
    out, hide_next = [], False
    for arg in args:
        if not isinstance(arg, str):
            out.append(arg)
            continue
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _value = arg.partition("=")
        if name.startswith("-") and _SECRET_NAME.search(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(_redact_url(arg))
    return out


def redact(value: Any, key: str = "") -> Any:
    """``value`` with every secret replaced by ``***`` (see the module's rules); other values unchanged."""
    if key and key not in _NOT_SECRET and _SECRET_NAME.search(key) and value not in (None, "", [], {}):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return _redact_args(value) if key == "args" else [redact(v) for v in value]
    if isinstance(value, str):
        return _redact_url(value)
    return value


def resolved_job(spec: JobSpec) -> dict[str, Any]:
    """The spec as it runs (defaults filled, JSON types), its secrets redacted."""
    return redact(spec.model_dump(mode="json"))
