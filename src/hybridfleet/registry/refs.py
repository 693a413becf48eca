"""Model names and references: ``[NAMESPACE/]NAME``, ``NAME@ALIAS``, ``NAME@VERSION`` (``@3`` or ``@v3``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridfleet.errors import RegistryError

DEFAULT_NAMESPACE = "default"
# Patterns are applied with fullmatch: `$` alone would also accept a trailing newline
# (``prod\n`` would be another, unprotected alias).
_PART = re.compile(r"[a-z0-9]([a-z0-9_.\-]{0,126}[a-z0-9])?")
_ALIAS = re.compile(r"[a-z][a-z0-9_\-]{0,63}")
_VERSION = re.compile(r"v?(\d+)")
MAX_VERSION = 2**31 - 1  # the database's integer column (32-bit on PostgreSQL)


@dataclass(frozen=True)
class ModelRef:
    namespace: str
    name: str
    version: int | None = None
    alias: str | None = None

    @property
    def full_name(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        at = f"@{self.alias}" if self.alias else (f"@{self.version}" if self.version is not None else "")
        return self.full_name + at


def parse_name(text: str) -> tuple[str, str]:
    """(namespace, name) of ``[NAMESPACE/]NAME``; lowercase letters, digits, ``_ . -``."""
    namespace, _, name = text.rpartition("/") if "/" in text else (DEFAULT_NAMESPACE, "", text)
    for part, what in ((namespace, "namespace"), (name, "model name")):
        if not _PART.fullmatch(part or ""):
            raise RegistryError(f"{what} {part!r} in {text!r}: use lowercase letters, digits, _ . - (1-128 characters)")
    return namespace, name


def check_alias(alias: str) -> str:
    """An alias name: starts with a letter (so it never reads as a version number)."""
    if not _ALIAS.fullmatch(alias or ""):
        raise RegistryError(f"alias {alias!r}: start with a lowercase letter; letters, digits, _ - (up to 64)")
    return alias


def check_version(number: int) -> int:
    """A version number as the registry stores them: 1 .. 2**31-1."""
    if not 1 <= number <= MAX_VERSION:
        raise RegistryError(f"version {number}: version numbers are 1 to {MAX_VERSION}")
    return number


def parse_ref(text: str) -> ModelRef:
    """Parse ``NAME``, ``NAME@ALIAS`` or ``NAME@VERSION`` (``3`` or ``v3``)."""
    base, sep, at = text.partition("@")
    namespace, name = parse_name(base)
    if not sep:
        return ModelRef(namespace, name)
    match = _VERSION.fullmatch(at)
    if match:
        return ModelRef(namespace, name, version=check_version(int(match.group(1))))
    return ModelRef(namespace, name, alias=check_alias(at))


# C0 and C1 control characters (newline, carriage return, escape ...): a stored text with one
# could forge lines or terminal escapes where it is printed (`hfleet registry history`).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_TEXT = 4096


def check_text(text: str, what: str, limit: int = MAX_TEXT) -> str:
    """A free text stored in the registry (a reason, a description): one line, no control characters."""
    if not isinstance(text, str):
        raise RegistryError(f"{what} must be text")
    if _CONTROL.search(text):
        raise RegistryError(f"{what} {text[:60]!r}: control characters (newlines included) are not allowed; "
                            f"write it on one line")
    if len(text) > limit:
        raise RegistryError(f"{what}: at most {limit} characters (got {len(text)})")
    return text


def check_tags(tags: dict[str, str]) -> dict[str, str]:
    """Tags as the database stores them: keys up to 128, values up to 512 characters, no control characters."""
    for key, value in tags.items():
        if not key:
            raise RegistryError("tag keys must not be empty")
        check_text(key, "tag key", 128)
        check_text(str(value), f"tag {key!r} value", 512)
    return tags
