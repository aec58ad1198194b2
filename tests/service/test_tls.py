"""TLS and mutual TLS on both ports, with a CA, a server and a client certificate made in the test."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from cbserve_client import AdminClient, Client
from cbserve_client.errors import UnavailableError
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from service_harness import ADMIN_TOKEN, ByteTokenizer, RunningServer

from service import cli
from service.tls import ServerTls, TlsConfigError, client_credentials, load_server_tls

# Failing handshakes surface as UNAVAILABLE well before this.
FAIL_TIMEOUT_S = 10


@dataclass
class Pki:
    folder: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing the server presents

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


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
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


def _write(folder: Path, name: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path = folder / f"{name}.pem"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("cbserve test CA", ca_key, None)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _certificate(
        "cbserve test server",
        server_key,
        (ca, ca_key),
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _certificate(
        "cbserve test client", client_key, (ca, ca_key), usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _certificate("some other CA", other_key, None)
    return Pki(
        folder=folder,
        ca=_write(folder, "ca", ca, ca_key),
        server_cert=_write(folder, "server", server, server_key),
        server_key=folder / "server.key",
        client_cert=_write(folder, "client", client, client_key),
        client_key=folder / "client.key",
        other_ca=_write(folder, "other-ca", other, other_key),
    )


def _assert_refused(target: str, credentials: grpc.ChannelCredentials | None, *, admin: bool = False) -> None:
    """The handshake fails: the call ends UNAVAILABLE."""
    if admin:
        with (
            AdminClient(target, ADMIN_TOKEN, credentials=credentials, timeout=FAIL_TIMEOUT_S) as admin_client,
            pytest.raises(UnavailableError),
        ):
            admin_client.status()
    else:
        with (
            Client(target, credentials=credentials, timeout=FAIL_TIMEOUT_S) as client,
            pytest.raises(UnavailableError),
        ):
            client.model_info()


def _serve(model: torch.nn.Module, tls: ServerTls | None) -> RunningServer:
    running = RunningServer(model, tokenizer=ByteTokenizer(), tls=tls)
    try:
        running.load()
    except BaseException:
        running.close()
        raise
    return running


@pytest.fixture(scope="module")
def tls_server(model: torch.nn.Module, pki: Pki) -> Iterator[RunningServer]:
    running = _serve(model, load_server_tls(str(pki.server_cert), str(pki.server_key)))
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def mtls_server(model: torch.nn.Module, pki: Pki) -> Iterator[RunningServer]:
    running = _serve(model, load_server_tls(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    try:
        yield running
    finally:
        running.close()


def test_tls_client_trusting_the_ca_is_served_on_both_ports(tls_server: RunningServer, pki: Pki) -> None:
    with Client(tls_server.target, credentials=pki.credentials(), timeout=30) as client:
        completion = client.generate("Hi", max_new_tokens=3, ignore_eos=True)
    assert len(completion.token_ids) == 3
    with AdminClient(
        tls_server.admin_target, ADMIN_TOKEN, credentials=pki.credentials(), timeout=30
    ) as admin:
        assert admin.status().running
    # The certificate names localhost too.
    localhost = f"localhost:{tls_server.server.port}"
    with Client(localhost, credentials=pki.credentials(), timeout=30) as client:
        assert client.model_info().model_name == "tiny"


def test_tls_refuses_plaintext_and_untrusted_clients_on_both_ports(
    tls_server: RunningServer, pki: Pki
) -> None:
    for credentials in (None, pki.credentials(ca=pki.other_ca)):
        _assert_refused(tls_server.target, credentials)
        _assert_refused(tls_server.admin_target, credentials, admin=True)


def test_mtls_requires_a_client_certificate_on_both_ports(mtls_server: RunningServer, pki: Pki) -> None:
    _assert_refused(mtls_server.target, pki.credentials())
    _assert_refused(mtls_server.admin_target, pki.credentials(), admin=True)
    _assert_refused(mtls_server.target, None)


def test_mtls_serves_a_client_with_its_certificate(mtls_server: RunningServer, pki: Pki) -> None:
    credentials = pki.credentials(with_client_cert=True)
    with Client(mtls_server.target, credentials=credentials, timeout=30) as client:
        completion = client.generate("Hi", max_new_tokens=2, ignore_eos=True)
    assert len(completion.token_ids) == 2
    with AdminClient(mtls_server.admin_target, ADMIN_TOKEN, credentials=credentials, timeout=30) as admin:
        assert admin.status().running


def test_a_client_certificate_from_another_ca_is_refused(
    mtls_server: RunningServer, pki: Pki, tmp_path: Path
) -> None:
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger_ca_key = ec.generate_private_key(ec.SECP256R1())
    stranger_ca = _certificate("stranger CA", stranger_ca_key, None)
    stranger = _certificate(
        "stranger", stranger_key, (stranger_ca, stranger_ca_key), usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    cert = _write(tmp_path, "stranger", stranger, stranger_key)
    credentials = client_credentials(str(pki.ca), str(cert), str(tmp_path / "stranger.key"))
    _assert_refused(mtls_server.target, credentials)


def test_tls_flag_mistakes_name_the_flag(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    cases = [
        ((missing, key, None), "--tls-cert: file not found"),
        ((cert, missing, None), "--tls-key: file not found"),
        ((cert, key, missing), "--tls-client-ca: file not found"),
        ((cert, str(not_pem), None), "--tls-key:"),
        ((cert, None, None), "--tls-key is required"),
        ((None, key, None), "--tls-cert is required"),
        ((None, None, ca), "--tls-client-ca needs --tls-cert"),
    ]
    for (cert_path, key_path, ca_path), message in cases:
        with pytest.raises(TlsConfigError, match=message):
            load_server_tls(cert_path, key_path, ca_path)
    assert load_server_tls(None, None, None) is None
    assert load_server_tls(cert, key, ca).mutual  # type: ignore[union-attr]


def test_serve_stops_at_once_on_a_missing_tls_file(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing.pem")
    # The model folder does not exist either: the TLS flags are checked before anything loads.
    argv = ["serve", "--model", str(tmp_path / "no-model"), "--port", "0", "--admin-port", "0"]
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--tls-cert", missing, "--tls-key", str(pki.server_key)])
    assert exited.value.code == 2
    assert f"--tls-cert: file not found: {missing}" in capsys.readouterr().err
