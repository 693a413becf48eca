"""The credential model: one token per worker bound to its id, revocation by jti, renewal in place,
and `hfleet ps status` / `hfleet certs` refusing what would leak or mislead."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from hybridfleet.errors import AuthError
from hybridfleet.security import TokenIssuer, TokenVerifier, generate_signing_key, make_dev_pki
from hybridfleet.security.credentials import issue_site_credentials, parse_worker_id, site_worker_ids
from hybridfleet.security.tokens import REVOKED_FILE, RevocationList, TokenRejectedError, revoke, unverified_claims
from hybridfleet.spec import parse_spec
from tests.ps_helpers import join_and_init, start_cluster


def _spec(**security):
    return parse_spec({"name": "job", "framework": "torch", "entrypoint": "train.py", "mode": "ps",
                       "sites": {"hospital": {"workers": 2}, "cloud": {"workers": 3}},
                       **({"security": security} if security else {})})


@pytest.fixture
def keys(tmp_path):
    generate_signing_key(tmp_path)
    return tmp_path


def test_site_credentials_bind_one_token_to_each_worker_of_the_site(keys):
    spec = _spec()
    creds = issue_site_credentials(spec, "cloud", TokenIssuer.from_dir(keys), ttl_s=120)
    assert list(creds.workers) == ["cloud-0", "cloud-1", "cloud-2"] == site_worker_ids(spec, "cloud")
    verifier = TokenVerifier.from_dir(keys, job="job")
    jtis = set()
    for wid, cred in creds.workers.items():
        claims = verifier.verify(cred.token, {"worker"})
        assert (claims.site, claims.role, claims.worker, claims.token_id) == ("cloud", "worker", wid, cred.token_id)
        assert 110 <= (cred.expires_at.timestamp() - time.time()) <= 121
        jtis.add(cred.token_id)
    assert len(jtis) == 3 and creds.client_cert is None
    assert parse_worker_id(spec, "cloud-2") == ("cloud", 2)
    assert parse_worker_id(spec, "cloud-3") is None and parse_worker_id(spec, "cloud-01") is None


def test_site_credentials_refuse_unknown_sites_and_mutual_tls_without_the_sites_certificate(keys, tmp_path):
    with pytest.raises(ValueError, match="site 'bank' is not in job 'job'"):
        issue_site_credentials(_spec(), "bank", TokenIssuer.from_dir(keys))
    pki = make_dev_pki(tmp_path / "pki", clients=["hospital"])
    spec = _spec(mutual_tls=True)
    assert issue_site_credentials(spec, "hospital", TokenIssuer.from_dir(keys), pki).client_cert == pki.clients["hospital"]
    with pytest.raises(AuthError, match="no client certificate for site 'cloud'"):
        issue_site_credentials(spec, "cloud", TokenIssuer.from_dir(keys), pki)


def test_revocation_list_is_reread_when_it_changes_and_fails_closed(keys):
    issuer = TokenIssuer.from_dir(keys)
    now = [0.0]
    verifier = TokenVerifier.from_dir(keys, job="job")
    verifier.revoked = RevocationList(keys / REVOKED_FILE, clock=lambda: now[0])
    token = issuer.issue("job", "cloud", "worker", 60, worker="cloud-0")
    other = issuer.issue("job", "cloud", "worker", 60, worker="cloud-1")
    verifier.verify(token)
    revoke(keys, [unverified_claims(token)["jti"]])
    now[0] += 2  # the list is looked at again at most once a second
    with pytest.raises(TokenRejectedError, match="has been revoked") as err:
        verifier.verify(token)
    assert err.value.reason == "revoked"
    verifier.verify(other)
    (keys / REVOKED_FILE).unlink()
    (keys / REVOKED_FILE).mkdir()  # unreadable: every token is refused until it is fixed
    now[0] += 2
    with pytest.raises(TokenRejectedError, match="revoked"):
        verifier.verify(other)


def test_token_without_jti_is_malformed(keys):
    import jwt
    from cryptography.hazmat.primitives import serialization

    from hybridfleet.security.tokens import SIGNING_KEY

    key = serialization.load_pem_private_key((keys / SIGNING_KEY).read_bytes(), password=None)
    token = jwt.encode({"job": "job", "site": "a", "role": "worker", "exp": int(time.time()) + 60}, key,
                       algorithm="EdDSA")
    with pytest.raises(TokenRejectedError, match="lacks the 'jti' claim"):
        TokenVerifier.from_dir(keys, job="job").verify(token)


@pytest.mark.parametrize("transport", ["auto", "grpc"], ids=["bulk", "grpc"])
def test_renewed_token_file_is_used_on_the_next_call_and_the_old_one_can_be_revoked(tmp_path, transport):
    from hybridfleet.ps.worker.client import ClientSecurity, PSClient
    from hybridfleet.security import load_pki

    cluster = start_cluster(tmp_path, transport=transport)
    try:
        token_file = tmp_path / "a-0.token"
        old = cluster.token("a", worker="a-0")
        token_file.write_text(old)
        sec = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert), token_file=str(token_file))
        client = PSClient(cluster.addresses, sec, "a-0", "a", 0, retry_timeout_s=2, transport=transport)
        join_and_init(cluster, client)
        # renewal: a new token replaces the file, the old one is revoked
        new = cluster.token("a", worker="a-0")
        token_file.write_text(new)
        revoke(cluster.certs, [unverified_claims(old)["jti"]])
        time.sleep(1.1)
        state = cluster.servers[0].state
        client.push({k: np.zeros(v.size, "<f4").tobytes() for k, v in state.params.items()}, codec="none", kind="INIT")
        client.pull(full=True)
        assert sec.current_token() == new
        # the revoked token alone is refused
        stale = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert), token=old)
        with pytest.raises(AuthError, match="has been revoked"):
            PSClient(cluster.addresses, stale, "a-0", "a", 0, retry_timeout_s=2, transport=transport).pull(full=True)
        client.close()
    finally:
        cluster.stop()


def test_hfleet_run_layout_gives_each_worker_a_private_token_file_that_renewal_replaces(tmp_path):
    from hybridfleet.launch.psjob import issue_tokens, prepare_security, worker_env

    spec = _spec(mutual_tls=True)
    layout = prepare_security(spec, tmp_path)
    files = {wid: layout.token_file(wid) for wid in ("hospital-0", "hospital-1", "cloud-0", "cloud-1", "cloud-2")}
    first = {wid: f.read_text() for wid, f in files.items()}
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files.values())
    env = worker_env(spec, tmp_path / "job.yaml", layout, "cloud", 4, 2)
    assert env["HFLEET_TOKEN_FILE"] == str(files["cloud-2"]) and "HFLEET_TOKEN" not in env
    assert env["HFLEET_CLIENT_CERT"].endswith("client-cloud.pem")  # the site's own certificate
    assert unverified_claims(first["cloud-2"])["wid"] == "cloud-2"
    issue_tokens(spec, layout)
    assert all(files[w].read_text() != first[w] for w in files)


def test_ps_status_refuses_plaintext_unless_told_insecure():
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "ps", "status", "127.0.0.1:1"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "HFLEET_TOKEN": "secret"})
    assert result.returncode != 0
    assert "--certs DIR is required to check the shard's TLS certificate" in result.stderr
    assert "or --insecure for a shard served without TLS (a token then travels unencrypted)" in result.stderr
    assert "Traceback" not in result.stderr


def test_ps_status_over_tls_with_a_monitor_token(tmp_path):
    cluster = start_cluster(tmp_path)
    try:
        env = {**os.environ, "HFLEET_TOKEN": cluster.token("a", role="monitor")}
        result = subprocess.run([sys.executable, "-m", "hybridfleet", "ps", "status", cluster.addresses[0],
                                 "--certs", str(cluster.certs)], capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0, result.stderr
        assert '"version": 0' in result.stdout
        # and a monitor cannot act as a worker
        from tests.ps_attack_helpers import grpc_stub
        from hybridfleet.ps.wire._proto import ps_pb2

        stub, md, channel = grpc_stub(cluster, env["HFLEET_TOKEN"])
        with pytest.raises(grpc.RpcError) as err:
            stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id="a-0"), metadata=md, timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        channel.close()
    finally:
        cluster.stop()
