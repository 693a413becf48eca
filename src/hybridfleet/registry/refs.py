"""Model names and references: ``[NAMESPACE/]NAME``, ``NAME@ALIAS``, ``NAME@VERSION`` (``@3`` or ``@v3``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridfleet.errors import RegistryError

DEFAULT_NAMESPACE = "default"
_PART = re.compile(r"^[a-z0-9]([a-z0-9_.\-]{0,126}[a-z0-9])?$")
_ALIAS = re.compile(r"^[a-z][a-z0-9_\-]{0,63}$")
_VERSION = re.compile(r"^v?(\d+)$")


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
        if not _PART.match(part or ""):
            raise RegistryError(f"{what} {part!r} in {text!r}: use lowercase letters, digits, _ . - (1-128 characters)")
    return namespace, name


def check_alias(alias: str) -> str:
    """An alias name: starts with a letter (so it never reads as a version number)."""
    if not _ALIAS.match(alias or ""):
        raise RegistryError(f"alias {alias!r}: start with a lowercase letter; letters, digits, _ - (up to 64)")
    return alias


def parse_ref(text: str) -> ModelRef:
    """Parse ``NAME``, ``NAME@ALIAS`` or ``NAME@VERSION`` (``3`` or ``v3``)."""
    base, sep, at = text.partition("@")
    namespace, name = parse_name(base)
    if not sep:
        return ModelRef(namespace, name)
    match = _VERSION.match(at)
    if match:
        return ModelRef(namespace, name, version=int(match.group(1)))
    return ModelRef(namespace, name, alias=check_alias(at))
