"""The certificates of the TLS tests: a CA, a server and a client certificate it signed, and another CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from service.tls import client_credentials


@dataclass
class Pki:
    """A CA, a server certificate (127.0.0.1 and localhost) and a client certificate it signed, and
    another CA that signed nothing the server presents."""

    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path

    def credentials(
        self, *, with_client_cert: bool = False, ca: Path | None = None
    ) -> grpc.ChannelCredentials:
        return client_credentials(
            str(ca or self.ca),
            str(self.client_cert) if with_client_cert else None,
            str(self.client_key) if with_client_cert else None,
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    """A certificate valid for a day; self-signed CA when `issuer` is None, else signed by it."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signing_key = (issuer[0].subject, issuer[1]) if issuer else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def write_pem(
    folder: Path, name: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Path:
    """Writes `name`.pem and `name`.key into `folder`; returns the certificate's path."""
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path = folder / f"{name}.pem"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def make_pki(folder: Path) -> Pki:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = make_certificate("cbserve test CA", ca_key, None)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = make_certificate(
        "cbserve test server",
        server_key,
        (ca, ca_key),
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = make_certificate(
        "cbserve test client", client_key, (ca, ca_key), usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = make_certificate("some other CA", other_key, None)
    return Pki(
        folder=folder,
        ca=write_pem(folder, "ca", ca, ca_key),
        server_cert=write_pem(folder, "server", server, server_key),
        server_key=folder / "server.key",
        client_cert=write_pem(folder, "client", client, client_key),
        client_key=folder / "client.key",
        other_ca=write_pem(folder, "other-ca", other, other_key),
    )
