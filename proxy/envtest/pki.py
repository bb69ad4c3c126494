"""Key material for a throw-away kube-apiserver: a CA, a loopback serving cert, an SA key pair.

kube-apiserver needs a serving certificate its clients can verify (opgate is configured with
``--upstream-ca``, never ``insecure``), and a service-account signing key so that TokenRequest,
OIDC discovery and JWKS work as in a real cluster. Generated per run with ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVING_DNS = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
               "kubernetes.default.svc.cluster.local")
SERVING_IPS = ("127.0.0.1", "::1", "10.0.0.1")


@dataclass(frozen=True, slots=True)
class PkiFiles:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_private: Path
    sa_public: Path


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.touch(mode=0o600)
    path.write_bytes(_key_pem(key))


def issue_serving_cert(directory: Path, *, name: str) -> tuple[Path, Path]:
    """Sign a loopback serving cert (``SERVING_DNS`` + ``SERVING_IPS``) with the CA that
    ``write_pki`` left in ``directory``; returns ``(<name>.crt, <name>.key)``."""
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, rsa.RSAPrivateKey)
    now = dt.datetime.now(dt.UTC)
    key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in SERVING_DNS]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVING_IPS]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return cert_path, key_path


def issue_client_cert(
    directory: Path, *, name: str, groups: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """Sign a client cert for the user ``name`` in ``groups`` (its organizations, as the
    apiserver's x509 authenticator reads them) with the CA that ``write_pki`` left in
    ``directory``: the credentials of a kubeconfig user such as kind's admin; returns
    ``(<name>.crt, <name>.key)``."""
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, rsa.RSAPrivateKey)
    now = dt.datetime.now(dt.UTC)
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                         *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return cert_path, key_path


def write_pki(directory: Path) -> PkiFiles:
    """Generate a CA (``ca.crt``/``ca.key``), the apiserver's serving cert and the SA key pair
    into ``directory`` (created; private keys mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    not_before, not_after = now - dt.timedelta(hours=1), now + dt.timedelta(days=7)

    ca_key = _key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("opgate-envtest-ca")).issuer_name(_name("opgate-envtest-ca"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    sa_key = _key()
    files = PkiFiles(
        ca_cert=directory / "ca.crt", serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key", sa_private=directory / "sa.key",
        sa_public=directory / "sa.pub",
    )
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / "ca.key", ca_key)
    _write_key(files.sa_private, sa_key)
    issue_serving_cert(directory, name="apiserver")
    files.sa_public.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return files
