"""The site hub under attack: real TLS sockets on 127.0.0.1, real tokens, a real sum.

Site ``h`` has three workers (leader h-0, followers h-1 and h-2); site ``c`` is another
site of the same job. Each test lets the honest followers reduce with the leader and
asserts the sum is exactly theirs: whatever the attacker sent added nothing, and the
hub admitted no one else.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import threading
import time

import numpy as np
import pytest

from hybridfleet.errors import AuthError
from hybridfleet.ps.worker.bulk_channel import client_ssl_context
from hybridfleet.ps.worker.site import PENDING_HANDSHAKES, SiteHub, SiteLink, _recv, open_hub
from hybridfleet.ps.worker.site_security import HUB_CERT_ENV, HUB_KEY_ENV, VERIFY_KEY_ENV, HubSecurity, \
    LinkSecurity
from hybridfleet.security.certs import hub_certificate_paths, issue_hub_certificate, make_dev_pki
from hybridfleet.security.credentials import issue_site_credentials
from hybridfleet.security.tokens import VERIFY_KEY, WORKER_ROLE, TokenIssuer, generate_signing_key
from hybridfleet.spec.models import JobSpec
from tests.ps_attack_helpers import wait_until

NUMEL = 6


def _job(mutual_tls: bool = False) -> JobSpec:
    return JobSpec.model_validate({
        "name": "hubjob", "framework": "torch", "entrypoint": "train.py", "mode": "ps",
        "sites": {"h": {"workers": 3, "aggregate": True}, "c": {"workers": 1}},
        "security": {"mutual_tls": mutual_tls}})


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    pki = make_dev_pki(d, clients=["h", "c"])
    issue_hub_certificate(pki, "h")
    issue_hub_certificate(pki, "c")
    generate_signing_key(d)
    return d


def _tokens(pki_dir, job, site):
    return {w: c.token for w, c in issue_site_credentials(job, site, TokenIssuer.from_dir(pki_dir)).workers.items()}


def _hub(pki_dir, job, site="h") -> SiteHub:
    return SiteHub("127.0.0.1:0", job.sites[site].workers - 1, NUMEL, _hub_security(pki_dir, job, site))


def _hub_security(pki_dir, job, site="h") -> HubSecurity:
    pair = hub_certificate_paths(pki_dir, site)
    env = {HUB_CERT_ENV: str(pair.cert), HUB_KEY_ENV: str(pair.key), "HFLEET_CA_CERT": str(pki_dir / "ca.pem"),
           VERIFY_KEY_ENV: str(pki_dir / VERIFY_KEY)}
    return HubSecurity.from_env(job, site, env)


def _link(pki_dir, hub, rank, token, site="h", client_cert_of=None, timeout_s=5.0, port_file=None) -> SiteLink:
    cert = (str(pki_dir / f"client-{client_cert_of}.pem"), str(pki_dir / f"client-{client_cert_of}.key")) \
        if client_cert_of else (None, None)
    ctx = client_ssl_context(str(pki_dir / "ca.pem"), *cert)
    address = "127.0.0.1:0" if port_file else f"127.0.0.1:{hub.port}"
    return SiteLink(address, rank, NUMEL, LinkSecurity(site, ctx, lambda: token), timeout_s=timeout_s,
                    port_file=port_file)


def _reduce(hub, links, step=1):
    """One honest step as the session runs it: the leader sends the parameters to followers that
    are new, every follower sends rank * ones, the leader sums, then sends everyone the parameters."""
    params = np.arange(NUMEL, dtype=np.float32)
    hub.admit(params, step)
    for rank, link in links.items():
        if not getattr(link, "started", False):
            got_step, got = link.receive()
            assert got_step == step and np.array_equal(got, params)
            link.started = True
        link.send(np.full(NUMEL, float(rank), np.float32))
    result = hub.gather(np.full(NUMEL, 100.0, np.float32))
    hub.broadcast(params + 1, step + 1)
    for link in links.values():
        got_step, got = link.receive()
        assert got_step == step + 1 and np.array_equal(got, params + 1)
    return result


@pytest.fixture
def site(pki_dir):
    job = _job()
    hub = _hub(pki_dir, job)
    yield job, hub, _tokens(pki_dir, job, "h")
    hub.close()


def _honest(pki_dir, hub, tokens):
    links = {r: _link(pki_dir, hub, r, tokens[f"h-{r}"]) for r in (1, 2)}
    assert hub.wait_for_followers(5.0) == 2
    return links


def _assert_honest_sum(hub, links):
    total, contributors = _reduce(hub, links)
    assert contributors == 3
    assert np.array_equal(total, np.full(NUMEL, 103.0, np.float32))  # 100 (leader) + 1 + 2, nothing else


def test_followers_with_their_own_tokens_reduce_with_the_leader(site, pki_dir):
    job, hub, tokens = site
    links = _honest(pki_dir, hub, tokens)
    _assert_honest_sum(hub, links)
    _assert_honest_sum(hub, links)  # a second step: the same two followers, no one else


@pytest.mark.parametrize("token,rank,message", [
    (None, 1, "missing token"),
    ("not-a-jwt", 1, "token"),
    ("h-0", 0, "site rank 1..2"),            # the leader's own id is not a follower's
    ("h-2", 1, "token is for worker 'h-2'; the hello claims worker 'h-1'"),
])
def test_a_follower_without_its_own_token_is_refused_and_adds_nothing(site, pki_dir, token, rank, message):
    job, hub, tokens = site
    with pytest.raises(AuthError, match=message):
        _link(pki_dir, hub, rank, tokens.get(token, token))
    assert hub.followers == 0 and hub.refused == 1
    _assert_honest_sum(hub, _honest(pki_dir, hub, tokens))


def test_a_token_of_another_site_is_refused(site, pki_dir):
    job, hub, tokens = site
    other = _tokens(pki_dir, job, "c")["c-0"]
    with pytest.raises(AuthError, match="token is for site 'c', this hub serves site 'h'"):
        _link(pki_dir, hub, 1, other)
    assert hub.followers == 0
    _assert_honest_sum(hub, _honest(pki_dir, hub, tokens))


def test_one_more_follower_than_the_site_has_is_refused(site, pki_dir):
    job, hub, tokens = site
    links = _honest(pki_dir, hub, tokens)
    # a validly signed token for a worker id the site does not have (h-3: the site has h-0..h-2)
    extra = TokenIssuer.from_dir(pki_dir).issue(job.name, "h", WORKER_ROLE, 60, worker="h-3")
    with pytest.raises(AuthError, match=r"site 'h' has followers of site rank 1..2; the hello names site rank 3"):
        _link(pki_dir, hub, 3, extra)
    assert hub.followers == 2
    _assert_honest_sum(hub, links)


def test_a_follower_reconnecting_replaces_its_old_connection_and_counts_once(site, pki_dir):
    job, hub, tokens = site
    links = _honest(pki_dir, hub, tokens)
    _assert_honest_sum(hub, links)
    links[1] = _link(pki_dir, hub, 1, tokens["h-1"])  # as after a restart of h-1
    assert wait_until(lambda: "h-1" in hub._pending, 5.0)  # admitted, joins at the next step
    assert hub.followers == 2
    _assert_honest_sum(hub, links)


def test_plaintext_and_garbage_connections_are_refused_and_add_nothing(site, pki_dir):
    job, hub, tokens = site
    plain = socket.create_connection(("127.0.0.1", hub.port))
    plain.settimeout(5.0)
    plain.sendall(struct.pack("<Q", 20) + json.dumps({"site_rank": 1}).encode()[:20])
    try:
        while plain.recv(1024):  # at most a TLS alert, then the hub closes (or resets) the connection
            pass
    except ConnectionResetError:
        pass
    plain.close()
    # a TLS peer announcing a 1 TiB hello: refused before anything is allocated
    ctx = client_ssl_context(str(pki_dir / "ca.pem"))
    with socket.create_connection(("127.0.0.1", hub.port)) as raw:
        with ctx.wrap_socket(raw, server_hostname="site-hub.hybridfleet") as tls:
            tls.sendall(struct.pack("<Q", 1 << 40))
            verdict = json.loads(_recv(tls, 4096, first_byte_timeout_s=5.0))
            assert verdict == {"ok": False, "error": "hello refused: site frame of 1099511627776 bytes exceeds "
                                                     "the expected 16384"}
            tls.settimeout(5.0)
            assert tls.recv(1) == b""  # then the hub closed it
    assert hub.followers == 0
    _assert_honest_sum(hub, _honest(pki_dir, hub, tokens))


def test_silent_connections_do_not_block_real_followers(site, pki_dir):
    job, hub, tokens = site
    silent = [socket.create_connection(("127.0.0.1", hub.port)) for _ in range(PENDING_HANDSHAKES + 8)]
    try:
        links = _honest(pki_dir, hub, tokens)  # within 5 s, while the silent ones still hold their sockets
        _assert_honest_sum(hub, links)
    finally:
        for s in silent:
            s.close()


class _SlowRelease:
    """The hub's pending-handshake slots, each release held back 0.3 s: the window in which a failed
    handshake's thread has not yet given its slot back."""

    def __init__(self, slots):
        self._slots = slots

    def take(self, fd, source):
        self._slots.take(fd, source)

    def release(self, fd):
        time.sleep(0.3)
        return self._slots.release(fd)


def test_a_follower_keeps_its_slot_when_a_failed_handshake_on_a_reused_descriptor_lets_go_late(site, pki_dir,
                                                                                               monkeypatch):
    """A connection whose TLS handshake fails keeps its descriptor open until its slot is released,
    so a follower accepted meanwhile never gets the same number and never loses its slot to the
    failed one's late release (which read "evicted before its handshake completed")."""
    job, hub, tokens = site
    hub._slots = _SlowRelease(hub._slots)
    first = socket.socket()  # the first follower's socket, made now: the hub's next descriptor is the dead one's
    real_connect = socket.create_connection

    def connect_first(address, timeout=None, *args, **kwargs):
        monkeypatch.setattr(socket, "create_connection", real_connect)
        first.settimeout(timeout)
        first.connect(address)
        return first

    dead = socket.create_connection(("127.0.0.1", hub.port))
    dead.close()  # EOF during the hub's TLS handshake
    assert wait_until(lambda: hub.refused == 1)  # failed; its release is still 0.3 s away
    monkeypatch.setattr(socket, "create_connection", connect_first)
    links = _honest(pki_dir, hub, tokens)
    _assert_honest_sum(hub, links)
    assert hub.refused == 1


def test_a_follower_checks_the_hub_is_its_own_sites(pki_dir):
    job = _job()
    other = _hub(pki_dir, job, site="c")
    try:
        with pytest.raises(AuthError, match="certificate is for site 'c', not 'h'"):
            _link(pki_dir, other, 1, _tokens(pki_dir, job, "h")["h-1"])
    finally:
        other.close()


def test_a_shard_certificate_does_not_pass_as_a_hub(pki_dir):
    job = _job()
    env = {HUB_CERT_ENV: str(pki_dir / "server.pem"), HUB_KEY_ENV: str(pki_dir / "server.key"),
           "HFLEET_CA_CERT": str(pki_dir / "ca.pem"), VERIFY_KEY_ENV: str(pki_dir / VERIFY_KEY)}
    hub = SiteHub("127.0.0.1:0", 2, NUMEL, HubSecurity.from_env(job, "h", env))
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            _link(pki_dir, hub, 1, _tokens(pki_dir, job, "h")["h-1"])
        assert hub.followers == 0
    finally:
        hub.close()


def test_with_mutual_tls_a_follower_must_show_its_sites_certificate(pki_dir):
    job = _job(mutual_tls=True)
    hub = _hub(pki_dir, job)
    tokens = _tokens(pki_dir, job, "h")
    try:
        with pytest.raises(AuthError, match="client certificate is for site 'c', this hub serves site 'h'"):
            _link(pki_dir, hub, 1, tokens["h-1"], client_cert_of="c")
        links = {r: _link(pki_dir, hub, r, tokens[f"h-{r}"], client_cert_of="h") for r in (1, 2)}
        assert hub.wait_for_followers(5.0) == 2
        _assert_honest_sum(hub, links)
    finally:
        hub.close()


def test_a_leader_without_hub_credentials_refuses_to_start_and_says_what_is_missing(pki_dir):
    job = _job()
    with pytest.raises(AuthError, match="HFLEET_SITE_HUB_CERT"):
        HubSecurity.from_env(job, "h", {"HFLEET_CA_CERT": str(pki_dir / "ca.pem")})
    pair = hub_certificate_paths(pki_dir, "h")
    with pytest.raises(AuthError, match="HFLEET_TOKEN_VERIFY_KEY"):
        HubSecurity.from_env(job, "h", {HUB_CERT_ENV: str(pair.cert), HUB_KEY_ENV: str(pair.key),
                                        "HFLEET_CA_CERT": str(pki_dir / "ca.pem")})


def test_hfleet_certs_hub_issues_the_certificate_a_leader_serves_with(tmp_path):
    from typer.testing import CliRunner

    from hybridfleet.cli.app import app

    runner = CliRunner()
    assert runner.invoke(app, ["certs", "init", str(tmp_path), "--client", "h"]).exit_code == 0
    result = runner.invoke(app, ["certs", "hub", str(tmp_path), "h"])
    assert result.exit_code == 0, result.output
    pair = hub_certificate_paths(tmp_path, "h")
    assert result.output.split() == [str(pair.cert), str(pair.key)]
    assert oct(pair.key.stat().st_mode & 0o777) == "0o600"
    bad = runner.invoke(app, ["certs", "hub", str(tmp_path), "no/such"])
    assert bad.exit_code != 0 and "not a valid client name" in bad.output
    assert sorted(p.name for p in tmp_path.glob("hub-*")) == ["hub-h.key", "hub-h.pem"]  # nothing else written
    job = _job()
    hub = _hub(tmp_path, job)
    try:
        with pytest.raises(AuthError, match="missing token"):  # the issued certificate serves: TLS completes
            _link(tmp_path, hub, 1, None)
    finally:
        hub.close()


def test_the_sum_carries_which_parameters_some_worker_had_a_gradient_for(pki_dir):
    # Prepare: two parameters (2 and 4 values); the leader has a gradient for neither, follower 1 for the second
    job = _job()
    pair = hub_certificate_paths(pki_dir, "h")
    env = {HUB_CERT_ENV: str(pair.cert), HUB_KEY_ENV: str(pair.key), "HFLEET_CA_CERT": str(pki_dir / "ca.pem"),
           VERIFY_KEY_ENV: str(pki_dir / VERIFY_KEY)}
    hub = SiteHub("127.0.0.1:0", 2, NUMEL, HubSecurity.from_env(job, "h", env), sizes=[2, 4])
    tokens = _tokens(pki_dir, job, "h")
    try:
        links = {}
        for r in (1, 2):
            links[r] = _link(pki_dir, hub, r, tokens[f"h-{r}"])
            links[r].params = 2
        assert hub.wait_for_followers(5.0) == 2
        hub.admit(np.zeros(NUMEL, np.float32), 1)
        for link in links.values():
            link.receive()
        # Execute: follower 1 is honest; follower 2 claims no gradient for the first parameter yet sends values
        links[1].send(np.array([0, 0, 1, 1, 1, 1], np.float32), np.array([0, 1]))
        links[2].send(np.array([5, 0, 2, 2, 2, 2], np.float32), np.array([0, 1]))
        total, present, contributors = hub.gather_present(np.zeros(NUMEL, np.float32), np.array([0, 0]))
        # Assert: the liar is dropped and adds nothing; only the second parameter had a gradient
        assert contributors == 2 and present.tolist() == [False, True]
        assert np.array_equal(total, np.array([0, 0, 1, 1, 1, 1], np.float32))
        with pytest.raises(ValueError, match="3 presence flags for 2 parameters"):
            links[1].send(np.zeros(NUMEL, np.float32), np.array([1, 1, 1]))
    finally:
        hub.close()


def test_the_leader_binds_its_own_port_and_its_followers_find_it_in_the_port_file(pki_dir, tmp_path):
    """`hfleet run` hands no hub port out (one picked and released could be taken first): the leader
    binds port 0, writes the port; followers wait for the file. A restarted leader keeps its port
    while free, else takes another, and followers connecting then find the new one."""
    # Prepare
    job, port_file = _job(), tmp_path / "site-hubs" / "h.port"
    tokens = _tokens(pki_dir, job, "h")
    links: dict[int, SiteLink] = {}
    early = threading.Thread(target=lambda: links.update({1: _link(pki_dir, None, 1, tokens["h-1"],
                                                                  port_file=str(port_file))}))
    early.start()  # a follower that starts before its leader waits for the file
    time.sleep(0.3)
    # Execute
    hub = open_hub("127.0.0.1:0", 2, NUMEL, _hub_security(pki_dir, job), port_file=str(port_file))
    links[2] = _link(pki_dir, None, 2, tokens["h-2"], port_file=str(port_file))
    early.join(10)
    first = hub.port
    # Assert
    assert port_file.read_text() == f"{first}\n"
    assert hub.wait_for_followers(5.0) == 2
    _assert_honest_sum(hub, links)
    for link in links.values():
        link.close()
    hub.close()
    # Execute: the leader restarts with its port free, then with another process holding it
    again = open_hub("127.0.0.1:0", 2, NUMEL, _hub_security(pki_dir, job), port_file=str(port_file))
    assert again.port == first
    again.close()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        moved = open_hub("127.0.0.1:0", 2, NUMEL, _hub_security(pki_dir, job), port_file=str(port_file))
        try:
            links = {r: _link(pki_dir, None, r, tokens[f"h-{r}"], port_file=str(port_file)) for r in (1, 2)}
            # Assert
            assert moved.port != first and port_file.read_text() == f"{moved.port}\n"
            assert moved.wait_for_followers(5.0) == 2
            _assert_honest_sum(moved, links)
        finally:
            for link in links.values():
                link.close()
            moved.close()


def test_a_follower_whose_port_file_never_appears_says_so(pki_dir, tmp_path):
    # Prepare
    job = _job()
    tokens = _tokens(pki_dir, job, "h")
    missing = tmp_path / "h.port"
    # Execute / Assert
    with pytest.raises(ConnectionError, match=f"site leader at the port in {missing} did not answer within 1 s"):
        _link(pki_dir, None, 1, tokens["h-1"], port_file=str(missing), timeout_s=1.0)
