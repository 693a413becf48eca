"""Signed tokens: issue, verify, and a precise reason for every rejection."""

from __future__ import annotations

import stat

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hybridfleet.errors import AuthError
from hybridfleet.security.tokens import (
    DEFAULT_LEEWAY_S,
    TokenIssuer,
    TokenRejectedError,
    TokenVerifier,
    generate_signing_key,
)

NOW_S = 1_800_000_000.0  # a fixed clock: expiry checks do not depend on how fast the test runs
JOB = "digits-hybrid"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return generate_signing_key(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def issuer(keys) -> TokenIssuer:
    return TokenIssuer(keys[0].read_bytes(), clock=lambda: NOW_S)


def _verifier(keys, now_s: float = NOW_S, job: str = JOB) -> TokenVerifier:
    return TokenVerifier(keys[1].read_bytes(), job=job, clock=lambda: now_s)


def _rejection(verifier: TokenVerifier, token, roles=None) -> TokenRejectedError:
    with pytest.raises(TokenRejectedError) as caught:
        verifier.verify(token, roles)
    return caught.value


def test_issued_token_verifies_to_its_claims(keys, issuer):
    # Prepare
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=600, subject="hospital/worker-0")

    # Execute
    claims = _verifier(keys).verify(token, roles={"worker", "shard"})

    # Assert
    assert (claims.job, claims.site, claims.role, claims.subject) == (JOB, "hospital", "worker", "hospital/worker-0")
    assert claims.expires_at.timestamp() == int(NOW_S + 600)
    assert claims.issued_at.timestamp() == int(NOW_S)


def test_token_signed_by_another_key_is_rejected_as_forged(tmp_path, keys):
    # Prepare
    other_priv, _ = generate_signing_key(tmp_path)
    forged = TokenIssuer(other_priv.read_bytes(), clock=lambda: NOW_S).issue(JOB, "cloud", "admin", ttl_s=600)

    # Execute
    err = _rejection(_verifier(keys), forged)

    # Assert
    assert err.reason == "forged"
    assert "signature is invalid" in str(err)


def test_expired_token_is_rejected_saying_how_long_ago(keys, issuer):
    # Prepare
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=60)

    # Execute
    err = _rejection(_verifier(keys, now_s=NOW_S + 60 + 90), token)

    # Assert
    assert err.reason == "expired"
    assert "token expired 90 s ago" in str(err)


def test_token_expired_within_the_leeway_is_accepted(keys, issuer):
    # Prepare
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=60)

    # Execute
    claims = _verifier(keys, now_s=NOW_S + 60 + DEFAULT_LEEWAY_S / 2).verify(token)

    # Assert
    assert claims.site == "hospital"


def test_token_issued_in_the_future_beyond_the_leeway_is_rejected(keys, issuer):
    # Prepare
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=3600)

    # Execute
    err = _rejection(_verifier(keys, now_s=NOW_S - 120), token)

    # Assert
    assert err.reason == "not_yet_valid"
    assert "issued 120 s in the future" in str(err)


def test_token_of_another_job_is_rejected_naming_both_jobs(keys, issuer):
    # Prepare
    token = issuer.issue("other-job", "hospital", "worker", ttl_s=600)

    # Execute
    err = _rejection(_verifier(keys), token)

    # Assert
    assert err.reason == "wrong_job"
    assert f"token is for job 'other-job', this server serves job '{JOB}'" in str(err)


def test_role_not_allowed_is_rejected_naming_role_and_allowed_roles(keys, issuer):
    # Prepare
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=600)

    # Execute
    err = _rejection(_verifier(keys), token, roles={"shard", "admin"})

    # Assert
    assert err.reason == "role"
    assert "role 'worker' is not allowed for this call (allowed: 'admin', 'shard')" in str(err)


@pytest.mark.parametrize("token", [None, ""])
def test_missing_token_is_rejected(keys, token):
    err = _rejection(_verifier(keys), token)
    assert err.reason == "missing"
    assert "missing token" in str(err)


@pytest.mark.parametrize("token", ["abc", "a.b.c", "not-base64!.x.y"])
def test_garbage_token_is_rejected_as_malformed(keys, token):
    err = _rejection(_verifier(keys), token)
    assert err.reason == "malformed"
    assert str(err).startswith("malformed token")


def test_signed_token_whose_payload_is_not_json_is_rejected_as_malformed(keys):
    # Prepare
    private_key = serialization.load_pem_private_key(keys[0].read_bytes(), password=None)
    token = jwt.api_jws.PyJWS().encode(b"not json", private_key, algorithm="EdDSA")

    # Execute
    err = _rejection(_verifier(keys), token)

    # Assert
    assert err.reason == "malformed"
    assert str(err).startswith("malformed token")


def test_token_without_role_claim_is_rejected_naming_the_claim(keys):
    # Prepare
    private_key = serialization.load_pem_private_key(keys[0].read_bytes(), password=None)
    token = jwt.encode({"job": JOB, "site": "s", "exp": int(NOW_S + 60)}, private_key, algorithm="EdDSA")

    # Execute
    err = _rejection(_verifier(keys), token)

    # Assert
    assert err.reason == "malformed"
    assert "lacks the 'role' claim" in str(err)


def test_token_with_non_string_site_is_rejected(keys):
    # Prepare
    private_key = serialization.load_pem_private_key(keys[0].read_bytes(), password=None)
    token = jwt.encode({"job": JOB, "site": 7, "role": "worker", "exp": int(NOW_S + 60), "jti": "t1"}, private_key, algorithm="EdDSA")

    # Execute
    err = _rejection(_verifier(keys), token)

    # Assert
    assert "claim 'site' must be a non-empty string" in str(err)


def test_hmac_token_keyed_with_the_public_key_is_rejected(keys):
    # Prepare: the classic algorithm-confusion forgery, HS256 with the public key as the secret
    claims = {"job": JOB, "site": "s", "role": "admin", "exp": int(NOW_S + 60)}
    token = jwt.api_jws.PyJWS().encode(
        jwt.utils.force_bytes(jwt.api_jwt.json.dumps(claims)), b"x" * 32, algorithm="HS256"
    )

    # Execute
    err = _rejection(_verifier(keys), token)

    # Assert
    assert err.reason == "forged"
    assert "algorithm 'HS256'; only 'EdDSA' is accepted" in str(err)


def test_rejections_are_auth_errors(keys):
    with pytest.raises(AuthError):
        _verifier(keys).verify(None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl_s": 0}, r"ttl_s: must be a number of seconds > 0 \(got 0\)"),
        ({"ttl_s": -5}, r"ttl_s: must be a number of seconds > 0 \(got -5\)"),
        ({"job": ""}, r"job: must be a non-empty string"),
        ({"role": " "}, r"role: must be a non-empty string"),
    ],
)
def test_issue_rejects_bad_arguments(issuer, kwargs, message):
    args = {"job": JOB, "site": "s", "role": "worker", "ttl_s": 60} | kwargs
    with pytest.raises(ValueError, match=message):
        issuer.issue(**args)


def test_issuer_rejects_a_non_ed25519_key():
    # Prepare
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )

    # Execute / Assert
    with pytest.raises(ValueError, match=r"tokens are signed with Ed25519, not EC"):
        TokenIssuer(pem)


def test_verifier_rejects_text_that_is_not_a_key():
    with pytest.raises(ValueError, match=r"public_key_pem: not a PEM public key"):
        TokenVerifier(b"hello", job=JOB)


def test_generate_signing_key_writes_private_key_owner_only(keys):
    assert stat.S_IMODE(keys[0].stat().st_mode) == 0o600
    assert keys[1].read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_generate_signing_key_refuses_to_overwrite(keys):
    # Prepare
    before = keys[0].read_bytes()

    # Execute
    with pytest.raises(AuthError, match=r"refusing to overwrite .*token-signing\.key"):
        generate_signing_key(keys[0].parent)

    # Assert
    assert keys[0].read_bytes() == before


def test_from_dir_round_trip(tmp_path):
    # Prepare
    generate_signing_key(tmp_path)

    # Execute
    token = TokenIssuer.from_dir(tmp_path).issue(JOB, "cloud", "shard", ttl_s=60)
    claims = TokenVerifier.from_dir(tmp_path, job=JOB).verify(token, roles={"shard"})

    # Assert
    assert claims.role == "shard"


def test_from_dir_without_keys_names_the_missing_file(tmp_path):
    with pytest.raises(AuthError, match=r"token-signing\.pub does not exist; create it with `hfleet certs init"):
        TokenVerifier.from_dir(tmp_path, job=JOB)
