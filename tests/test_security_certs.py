"""The dev PKI: files, permissions, SANs, validation messages and the `hfleet certs` commands."""

from __future__ import annotations

import ipaddress
import re
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from typer.testing import CliRunner

from hybridfleet.cli.app import app
from hybridfleet.errors import AuthError
from hybridfleet.security import certs
from hybridfleet.security.tokens import TokenVerifier


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    return cert.issuer == ca.subject


def _plain(output: str) -> str:
    """CLI output without the rich error box, on one line (the box wraps long messages)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> certs.Pki:
    return certs.make_dev_pki(
        tmp_path_factory.mktemp("pki"), hosts=("127.0.0.1", "::1", "ps.internal"), clients=("worker", "shard")
    )


def test_dev_pki_server_cert_has_ip_and_dns_sans_for_every_host(pki):
    # Execute
    sans = _cert(pki.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    # Assert
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert sans.get_values_for_type(x509.DNSName) == ["ps.internal"]


def test_dev_pki_certs_are_signed_by_the_ca_for_their_purpose(pki):
    # Prepare
    ca = _cert(pki.ca_cert)

    # Execute
    server = _cert(pki.server_cert)
    clients = {name: _cert(pair.cert) for name, pair in pki.clients.items()}

    # Assert
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert _signed_by(server, ca)
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert sorted(clients) == ["shard", "worker"]
    for client in clients.values():
        assert _signed_by(client, ca)
        assert ExtendedKeyUsageOID.CLIENT_AUTH in client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value


def test_dev_pki_private_keys_are_readable_by_owner_only(pki):
    # Prepare
    keys = [pki.server_key, pki.ca_key] + [pair.key for pair in pki.clients.values()]

    # Execute
    modes = {key.name: stat.S_IMODE(key.stat().st_mode) for key in keys}

    # Assert
    assert modes == {key.name: 0o600 for key in keys}


def test_load_pki_finds_every_client_of_a_made_pki(pki):
    # Execute
    loaded = certs.load_pki(pki.directory)

    # Assert
    assert loaded == pki


def test_load_pki_names_the_missing_file(tmp_path):
    # Prepare
    made = certs.make_dev_pki(tmp_path / "pki")
    made.server_key.unlink()

    # Execute / Assert
    with pytest.raises(AuthError, match=r"missing server\.key"):
        certs.load_pki(made.directory)


def test_load_pki_names_a_client_cert_without_its_key(tmp_path):
    # Prepare
    made = certs.make_dev_pki(tmp_path / "pki", clients=("worker",))
    made.clients["worker"].key.unlink()

    # Execute / Assert
    with pytest.raises(AuthError, match=r"missing client-worker\.key, the key of client certificate client-worker\.pem"):
        certs.load_pki(made.directory)


def test_load_pki_of_a_missing_directory_says_how_to_create_it(tmp_path):
    with pytest.raises(AuthError, match=r"does not exist; create it with `hfleet certs init"):
        certs.load_pki(tmp_path / "absent")


def test_load_pki_rejects_a_certificate_that_is_not_pem(tmp_path):
    # Prepare
    made = certs.make_dev_pki(tmp_path / "pki")
    made.ca_cert.write_text("not a certificate")

    # Execute / Assert
    with pytest.raises(AuthError, match=r"ca\.pem is not a PEM certificate"):
        certs.load_pki(made.directory)


def test_make_dev_pki_refuses_to_overwrite_and_leaves_files_unchanged(tmp_path):
    # Prepare
    made = certs.make_dev_pki(tmp_path / "pki")
    before = _snapshot(made.directory)

    # Execute
    with pytest.raises(AuthError, match=r"refusing to overwrite .*ca\.pem"):
        certs.make_dev_pki(made.directory)

    # Assert
    assert _snapshot(made.directory) == before


def test_make_dev_pki_with_overwrite_replaces_the_ca(tmp_path):
    # Prepare
    made = certs.make_dev_pki(tmp_path / "pki")
    old_ca = made.ca_cert.read_bytes()

    # Execute
    certs.make_dev_pki(made.directory, overwrite=True)

    # Assert
    assert made.ca_cert.read_bytes() != old_ca


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hosts": ()}, r"hosts: the server certificate needs at least one host"),
        ({"hosts": ("bad_host!",)}, r"hosts: 'bad_host!' is neither an IP address nor a valid DNS name"),
        ({"clients": ("../escape",)}, r"clients: '\.\./escape' is not a valid client name"),
        ({"clients": ("w", "w")}, r"clients: names must be unique \(repeated: w\)"),
        ({"valid_days": 0}, r"valid_days: must be > 0 \(got 0\)"),
    ],
)
def test_make_dev_pki_rejects_bad_input_without_writing(tmp_path, kwargs, message):
    # Execute
    with pytest.raises(ValueError, match=message):
        certs.make_dev_pki(tmp_path / "pki", **kwargs)

    # Assert
    assert not (tmp_path / "pki").exists()


def test_channel_credentials_for_an_unknown_client_lists_the_known_ones(pki):
    with pytest.raises(AuthError, match=r"no client certificate named 'ghost' .*\(available: shard, worker\)"):
        certs.channel_credentials(pki, client_name="ghost")


def test_channel_credentials_from_the_ca_file_alone_cannot_add_a_client_cert(pki):
    with pytest.raises(ValueError, match=r"client_name='worker' needs a PKI directory, not the CA file"):
        certs.channel_credentials(pki.ca_cert, client_name="worker")


def test_channel_credentials_for_a_missing_ca_file_names_it(tmp_path):
    with pytest.raises(AuthError, match=r"CA certificate .*nope\.pem does not exist"):
        certs.channel_credentials(tmp_path / "nope.pem")


# --- hfleet certs ---------------------------------------------------------------------------

runner = CliRunner()


def test_cli_init_writes_pki_and_token_keys_and_token_verifies(tmp_path):
    # Prepare
    directory = tmp_path / "deploy"

    # Execute
    init = runner.invoke(app, ["certs", "init", str(directory), "--host", "10.1.2.3", "--client", "hospital"])
    token = runner.invoke(
        app, ["certs", "token", str(directory), "--job", "j1", "--site", "hospital", "--role", "worker", "--ttl-s", "600"]
    )

    # Assert
    assert init.exit_code == 0, init.output
    pki = certs.load_pki(directory)
    assert list(pki.clients) == ["hospital"]
    assert stat.S_IMODE((directory / "token-signing.key").stat().st_mode) == 0o600
    assert token.exit_code == 0, token.output
    claims = TokenVerifier.from_dir(directory, job="j1").verify(token.stdout.strip(), roles={"worker"})
    assert (claims.site, claims.role) == ("hospital", "worker")


def test_cli_show_prints_subjects_sans_and_expiry(tmp_path):
    # Prepare
    pki = certs.make_dev_pki(tmp_path / "pki", hosts=("10.9.8.7", "ps.example.org"))
    expiry = _cert(pki.server_cert).not_valid_after_utc.isoformat()

    # Execute
    result = runner.invoke(app, ["certs", "show", str(pki.directory)])

    # Assert
    assert result.exit_code == 0, result.output
    assert "CN=10.9.8.7" in result.stdout
    assert "sans:      ps.example.org, 10.9.8.7" in result.stdout
    assert expiry in result.stdout
    assert "token key token-signing.key: missing" in result.stdout


def test_cli_init_refuses_an_existing_pki_and_leaves_it_unchanged(tmp_path):
    # Prepare
    directory = tmp_path / "pki"
    assert runner.invoke(app, ["certs", "init", str(directory)]).exit_code == 0
    before = _snapshot(directory)

    # Execute
    result = runner.invoke(app, ["certs", "init", str(directory)])

    # Assert
    assert isinstance(result.exception, AuthError)
    assert "refusing to overwrite" in str(result.exception) and "token-signing.key" in str(result.exception)
    assert _snapshot(directory) == before


def test_cli_init_with_a_bad_host_is_a_usage_error_naming_it(tmp_path):
    # Execute
    result = runner.invoke(app, ["certs", "init", str(tmp_path / "pki"), "--host", "bad_host!"])

    # Assert
    assert result.exit_code == 2
    assert "'bad_host!' is neither an IP address nor a valid DNS name" in _plain(result.output)
    assert not (tmp_path / "pki").exists()


def test_cli_token_with_zero_ttl_is_a_usage_error(tmp_path):
    # Prepare
    assert runner.invoke(app, ["certs", "init", str(tmp_path)]).exit_code == 0

    # Execute
    result = runner.invoke(app, ["certs", "token", str(tmp_path), "--job", "j", "--site", "s", "--role", "worker", "--ttl-s", "0"])

    # Assert
    assert result.exit_code == 2
    assert "ttl_s: must be a number of seconds > 0" in _plain(result.output)


def test_cli_token_without_signing_key_names_the_file(tmp_path):
    # Execute
    result = runner.invoke(app, ["certs", "token", str(tmp_path), "--job", "j", "--site", "s", "--role", "worker"])

    # Assert
    assert isinstance(result.exception, AuthError)
    assert "token-signing.key does not exist" in str(result.exception)
