"""`hfleet serve`'s token gate: one registry check per token per ``ttl_s``, malformed headers refused
without one, a removed principal refused once its answer has expired, and expired answers dropped."""

from __future__ import annotations

import time

import pytest

from hybridfleet.errors import AuthError, PermissionDeniedError
from hybridfleet.registry import Registry
from hybridfleet.serve.auth import TokenGate, registry_reader_check


class CountingCheck:
    """A token check that counts its calls; tokens in ``refused`` have no reader role."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.refused: set[str] = set()

    def __call__(self, token: str) -> None:
        self.calls.append(token)
        if token in self.refused:
            raise PermissionDeniedError("needs role 'reader'")


def test_a_token_is_checked_once_per_ttl_and_a_refusal_is_kept_too():
    check = CountingCheck()
    check.refused.add("bad")
    gate = TokenGate(check, ttl_s=60)
    for _ in range(5):
        gate.check("Bearer good")
        with pytest.raises(PermissionDeniedError):
            gate.check("Bearer bad")
    assert check.calls == ["good", "bad"]
    assert gate.cached_refusal("Bearer good") is None
    assert isinstance(gate.cached_refusal("Bearer bad"), PermissionDeniedError)
    assert gate.cached_refusal("Bearer unseen") is False  # not known: the caller checks it


@pytest.mark.parametrize("header,message", [
    (None, "missing token"), ("Basic abc", "missing token"), ("Bearer ", "malformed bearer token"),
    ("Bearer a b", "malformed bearer token"), ("Bearer \u00a0", "malformed bearer token"),
])  # fmt: skip
def test_a_malformed_header_is_refused_without_a_registry_check_and_not_kept(header, message):
    check = CountingCheck()
    gate = TokenGate(check, ttl_s=60)
    refusal = gate.cached_refusal(header)
    with pytest.raises(AuthError) as raised:
        gate.check(header)
    assert isinstance(refusal, AuthError) and message in str(refusal) and message in str(raised.value)
    assert check.calls == [] and gate._cache == {}


def test_a_removed_principal_is_refused_once_its_answer_expires(tmp_path):
    # Prepare: a real registry, a reader's token that passes once
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    token = reg.add_principal("svc", "service")
    reg.grant("svc", "reader", "default/digits")
    gate = TokenGate(registry_reader_check(reg, "default/digits"), ttl_s=0.2)
    gate.check(f"Bearer {token}")
    # Execute: the principal is removed; its answer stands until it expires, then the registry refuses
    reg.remove_principal("svc")
    gate.check(f"Bearer {token}")
    time.sleep(0.3)
    with pytest.raises(AuthError):
        gate.check(f"Bearer {token}")


def test_answers_past_their_time_are_dropped_when_the_next_one_is_kept():
    gate = TokenGate(CountingCheck(), ttl_s=0.05)
    for i in range(20):
        gate.check(f"Bearer old-{i}")
    time.sleep(0.1)
    gate.check("Bearer new")
    assert list(gate._cache) == ["Bearer new"]
