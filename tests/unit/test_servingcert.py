"""proxy/relay/servingcert.py: the certificate's expiry read without a certificate library."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proxy.relay import servingcert

NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


def write_cert(path: Path, not_after: dt.datetime, *, extensions: bool = True) -> None:
    """A self-signed certificate ending at ``not_after`` (X.509 v3; the builder always writes
    the version, so ``extensions`` only varies what follows the validity)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(oid, "x" * 60) for oid in (  # (long-form lengths)
        NameOID.ORGANIZATION_NAME, NameOID.ORGANIZATIONAL_UNIT_NAME, NameOID.COMMON_NAME)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_after - dt.timedelta(days=3)).not_valid_after(not_after))
    if extensions:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                        critical=True)
    path.write_bytes(b"# a comment before the block\n"
                     + builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


@pytest.mark.parametrize(("not_after", "is_expired"), [
    (NOW - dt.timedelta(hours=1), True),
    (NOW + dt.timedelta(hours=1), False),
    (dt.datetime(2049, 12, 31, 23, 59, 59, tzinfo=dt.UTC), False),  # UTCTime's last year
    (dt.datetime(2051, 1, 1, tzinfo=dt.UTC), False),  # GeneralizedTime from 2050 on
    (dt.datetime(2001, 1, 1, tzinfo=dt.UTC), True),
], ids=["an-hour-ago", "in-an-hour", "2049-utctime", "2051-generalizedtime", "2001"])
@pytest.mark.parametrize("extensions", [True, False])
def test_expired_reads_not_after(tmp_path: Path, not_after: dt.datetime, is_expired: bool,
                                 extensions: bool) -> None:
    cert = tmp_path / "tls.crt"
    write_cert(cert, not_after, extensions=extensions)
    why = servingcert.expired(str(cert))
    if is_expired:
        assert why == (f"--tls-cert {cert}: the certificate expired at "
                       f"{not_after:%Y-%m-%dT%H:%M:%SZ}")
    else:
        assert why is None


@pytest.mark.parametrize("content", [b"", b"not PEM\n", b"-----BEGIN CERTIFICATE-----\nAAAA\n"
                                     b"-----END CERTIFICATE-----\n"])
def test_what_is_no_certificate_is_left_to_load_cert_chain(tmp_path: Path,
                                                           content: bytes) -> None:
    cert = tmp_path / "tls.crt"
    cert.write_bytes(content)
    assert servingcert.expired(str(cert)) is None
