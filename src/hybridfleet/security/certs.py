"""A development PKI for the parameter server: CA, server and client certificates.

`make_dev_pki` writes one directory per job (or per deployment)::

    ca.pem  ca.key                      the CA that signs everything below
    server.pem  server.key              the shards' certificate, one SAN per host
    client-<name>.pem  client-<name>.key  client certificates for mutual TLS

Keys are EC P-256 in PKCS#8 PEM, written with mode 0600; certificates are PEM.
`server_credentials` / `channel_credentials` turn the directory into gRPC
credentials.

gRPC checks the host name the client dials against the server certificate's
SubjectAltNames: dial a host listed in ``hosts`` (IP addresses become IP SANs,
names become DNS SANs). Where the dialled name cannot match (a load balancer,
an IP not known when the PKI was made) pass the channel option
``("grpc.ssl_target_name_override", "<a host in the SANs>")``; the certificate
is still verified against the CA, only the name compared changes.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hybridfleet.errors import AuthError
from hybridfleet.obs.log import get_logger

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
CLIENT_PREFIX = "client-"
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_CLIENTS = ("worker",)
DEFAULT_VALID_DAYS = 30
KEY_FILE_MODE = 0o600
CERT_FILE_MODE = 0o644
# Certificates start a little in the past so a peer whose clock lags still accepts them.
_BACKDATE = dt.timedelta(minutes=5)
_CLIENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

log = get_logger("security.certs")


@dataclass(frozen=True)
class CertKeyPair:
    """Paths of one certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Paths of a PKI directory; `ca_key` is None where the CA key was kept elsewhere."""

    directory: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    ca_key: Path | None = None
    clients: dict[str, CertKeyPair] = field(default_factory=dict)


@dataclass(frozen=True)
class CertInfo:
    """What `hfleet certs show` prints about one certificate."""

    name: str
    path: Path
    subject: str
    issuer: str
    sans: tuple[str, ...]
    not_before: dt.datetime
    not_after: dt.datetime
    is_ca: bool
    sha256_fingerprint: str


def _check_hosts(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    hosts = list(hosts)
    if not hosts:
        raise ValueError("hosts: the server certificate needs at least one host (an IP address or a DNS name)")
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
            continue
        except ValueError:
            pass
        labels = host.rstrip(".").split(".")
        if not host or len(host) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
            raise ValueError(f"hosts: {host!r} is neither an IP address nor a valid DNS name")
        names.append(x509.DNSName(host))
    return names


def _check_clients(clients: Iterable[str]) -> list[str]:
    clients = list(clients)
    for name in clients:
        if not _CLIENT_NAME.match(name):
            raise ValueError(
                f"clients: {name!r} is not a valid client name (letters, digits, '_', '.', '-'; at most 63 characters)"
            )
    duplicates = sorted({name for name in clients if clients.count(name) > 1})
    if duplicates:
        raise ValueError(f"clients: names must be unique (repeated: {', '.join(duplicates)})")
    return clients


def write_file_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` atomically with ``mode`` from the first byte (a key is never world-readable)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hybridfleet"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _sign(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer_cert: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    valid_days: float,
    extensions: list[tuple[x509.ExtensionType, bool]],
) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert else subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _usage(**enabled: bool) -> x509.KeyUsage:
    flags = dict.fromkeys(
        [
            "digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
            "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only",
        ],
        False,
    )
    flags.update(enabled)
    return x509.KeyUsage(**flags)


def _leaf(
    common_name: str,
    purpose: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    valid_days: float,
) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    extensions: list[tuple[x509.ExtensionType, bool]] = [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (_usage(digital_signature=True), True),
        (x509.ExtendedKeyUsage([purpose]), False),
    ]
    if sans:
        extensions.append((x509.SubjectAlternativeName(sans), False))
    cert = _sign(_name(common_name), key.public_key(), ca_cert, ca_key, valid_days, extensions)
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_dev_pki(
    out_dir: str | os.PathLike[str],
    hosts: Iterable[str] = DEFAULT_HOSTS,
    clients: Iterable[str] = DEFAULT_CLIENTS,
    valid_days: float = DEFAULT_VALID_DAYS,
    overwrite: bool = False,
) -> Pki:
    """Create a CA, a server certificate with one SAN per host, and one client certificate per name.

    All inputs are checked before anything is written; without ``overwrite`` an
    existing PKI file is an `AuthError` and the directory is left as it was.
    Keys are written 0600, certificates 0644.
    """
    directory = Path(out_dir)
    sans = _check_hosts(hosts)
    client_names = _check_clients(clients)
    if not valid_days > 0:
        raise ValueError(f"valid_days: must be > 0 (got {valid_days})")
    if directory.exists() and not directory.is_dir():
        raise AuthError(f"{directory} exists and is not a directory")
    outputs = [CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY]
    for name in client_names:
        outputs += [f"{CLIENT_PREFIX}{name}.pem", f"{CLIENT_PREFIX}{name}.key"]
    existing = [name for name in outputs if (directory / name).exists()]
    if existing and not overwrite:
        raise AuthError(
            f"refusing to overwrite {', '.join(str(directory / n) for n in existing)}; "
            "choose another directory or pass overwrite (CLI: --force)"
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _sign(
        _name("hybridfleet dev CA"),
        ca_key.public_key(),
        None,
        ca_key,
        valid_days,
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (_usage(digital_signature=True, key_cert_sign=True, crl_sign=True), True),
        ],
    )
    first_host = str(sans[0].value)
    files: dict[str, tuple[bytes, int]] = {
        CA_CERT: (ca_cert.public_bytes(serialization.Encoding.PEM), CERT_FILE_MODE),
        CA_KEY: (_key_pem(ca_key), KEY_FILE_MODE),
    }
    server_pem, server_key = _leaf(first_host, ExtendedKeyUsageOID.SERVER_AUTH, sans, ca_cert, ca_key, valid_days)
    files[SERVER_CERT] = (server_pem, CERT_FILE_MODE)
    files[SERVER_KEY] = (server_key, KEY_FILE_MODE)
    for name in client_names:
        pem, key = _leaf(name, ExtendedKeyUsageOID.CLIENT_AUTH, [], ca_cert, ca_key, valid_days)
        files[f"{CLIENT_PREFIX}{name}.pem"] = (pem, CERT_FILE_MODE)
        files[f"{CLIENT_PREFIX}{name}.key"] = (key, KEY_FILE_MODE)

    directory.mkdir(parents=True, exist_ok=True)
    for name, (data, mode) in files.items():
        write_file_atomic(directory / name, data, mode)
    log.info("pki_created", directory=str(directory), hosts=[str(s.value) for s in sans], clients=client_names)
    return load_pki(directory)


HUB_PREFIX = "hub-"
# The one name a site hub's certificate is valid for: no shard address, so a site leader
# holding it cannot pass as a shard; its common name is the site, which followers check.
HUB_SERVER_NAME = "site-hub.hybridfleet"


def hub_certificate_paths(directory: str | os.PathLike[str], site: str) -> CertKeyPair:
    """Where the site hub certificate of ``site`` lives in a PKI directory."""
    root = Path(directory)
    return CertKeyPair(root / f"{HUB_PREFIX}{site}.pem", root / f"{HUB_PREFIX}{site}.key")


def issue_hub_certificate(pki: Pki, site: str, valid_days: float = DEFAULT_VALID_DAYS) -> CertKeyPair:
    """A server certificate for the site hub of ``site`` (common name the site, the only SAN
    `HUB_SERVER_NAME`), signed by the PKI's CA; kept when it already exists. Raises `AuthError`
    when the CA key is not in the directory and the certificate does not exist yet."""
    (site,) = _check_clients([site])
    pair = hub_certificate_paths(pki.directory, site)
    if pair.cert.is_file() and pair.key.is_file():
        return pair
    if pki.ca_key is None:
        raise AuthError(f"{pki.directory} has no CA key to issue the site hub certificate of site {site!r}; "
                        f"put {pair.cert.name} and {pair.key.name} there")
    ca_cert = _read_cert(pki.ca_cert)
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    pem, key = _leaf(site, ExtendedKeyUsageOID.SERVER_AUTH, [x509.DNSName(HUB_SERVER_NAME)], ca_cert, ca_key,
                     valid_days)
    write_file_atomic(pair.key, key, KEY_FILE_MODE)
    write_file_atomic(pair.cert, pem, CERT_FILE_MODE)
    return pair


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as err:
        raise AuthError(f"{path} is not a PEM certificate ({err})") from None


def load_pki(directory: str | os.PathLike[str]) -> Pki:
    """The `Pki` of a directory made by `make_dev_pki` (or laid out the same way).

    Raises `AuthError` naming the first missing or unreadable file; client
    certificates are optional but each one needs its key.
    """
    root = Path(directory)
    if not root.is_dir():
        raise AuthError(f"TLS directory {root} does not exist; create it with `hfleet certs init {root}`",
                        hint=f"pass the directory that holds the job's certificates, or create one with "
                             f"`hfleet certs init {root}`")
    for name in (CA_CERT, SERVER_CERT, SERVER_KEY):
        if not (root / name).is_file():
            raise AuthError(f"TLS directory {root} is missing {name} (expected at {root / name})")
    for name in (CA_CERT, SERVER_CERT):
        _read_cert(root / name)
    clients: dict[str, CertKeyPair] = {}
    for cert in sorted(root.glob(f"{CLIENT_PREFIX}*.pem")):
        client = cert.name[len(CLIENT_PREFIX) : -len(".pem")]
        key = cert.with_suffix(".key")
        if not key.is_file():
            raise AuthError(f"TLS directory {root} is missing {key.name}, the key of client certificate {cert.name}")
        clients[client] = CertKeyPair(cert, key)
    ca_key = root / CA_KEY
    return Pki(
        directory=root,
        ca_cert=root / CA_CERT,
        server_cert=root / SERVER_CERT,
        server_key=root / SERVER_KEY,
        ca_key=ca_key if ca_key.is_file() else None,
        clients=clients,
    )


def server_credentials(pki: Pki, mutual_tls: bool) -> grpc.ServerCredentials:
    """TLS credentials for a gRPC server; with ``mutual_tls`` clients must show a certificate from the CA."""
    return grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca_cert.read_bytes() if mutual_tls else None,
        require_client_auth=mutual_tls,
    )


def channel_credentials(
    pki_or_ca_path: Pki | str | os.PathLike[str], client_name: str | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials for a gRPC client that trusts the PKI's CA.

    ``pki_or_ca_path`` is a `Pki`, a PKI directory, or the CA certificate file
    alone. ``client_name`` adds that client's certificate (needed when the
    server requires mutual TLS); it needs a `Pki` or a directory.
    """
    pki: Pki | None
    if isinstance(pki_or_ca_path, Pki):
        pki = pki_or_ca_path
    elif Path(pki_or_ca_path).is_dir():
        pki = load_pki(pki_or_ca_path)
    else:
        pki = None
    ca_path = pki.ca_cert if pki else Path(pki_or_ca_path)
    if not ca_path.is_file():
        raise AuthError(f"CA certificate {ca_path} does not exist")
    _read_cert(ca_path)
    if client_name is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_path.read_bytes())
    if pki is None:
        raise ValueError(f"client_name={client_name!r} needs a PKI directory, not the CA file {ca_path} alone")
    if client_name not in pki.clients:
        known = ", ".join(sorted(pki.clients)) or "none"
        raise AuthError(f"no client certificate named {client_name!r} in {pki.directory} (available: {known})")
    pair = pki.clients[client_name]
    return grpc.ssl_channel_credentials(
        root_certificates=ca_path.read_bytes(),
        private_key=pair.key.read_bytes(),
        certificate_chain=pair.cert.read_bytes(),
    )


def describe_certificate(name: str, path: Path) -> CertInfo:
    """Subject, issuer, SANs, validity and fingerprint of one PEM certificate."""
    cert = _read_cert(path)
    try:
        san_ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = tuple(str(v) for v in san_ext.get_values_for_type(x509.DNSName)) + tuple(
            str(v) for v in san_ext.get_values_for_type(x509.IPAddress)
        )
    except x509.ExtensionNotFound:
        sans = ()
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    return CertInfo(
        name=name,
        path=path,
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        sans=sans,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        is_ca=is_ca,
        sha256_fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
    )


def describe_pki(pki: Pki) -> list[CertInfo]:
    """`CertInfo` for the CA, the server and every client certificate, in that order."""
    infos = [describe_certificate("ca", pki.ca_cert), describe_certificate("server", pki.server_cert)]
    infos += [describe_certificate(f"client {name}", pair.cert) for name, pair in sorted(pki.clients.items())]
    return infos
