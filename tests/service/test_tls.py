"""TLS and mutual TLS on both ports, with a CA, a server and a client certificate made in the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from cbserve_client import AdminClient, Client
from cbserve_client.errors import UnavailableError
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from service import cli
from service.tls import TlsConfigError, client_credentials, load_server_tls
from tests.helpers.certificates import Pki, make_certificate, make_pki, write_pem
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, loaded_server

# Failing handshakes surface as UNAVAILABLE well before this.
FAIL_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


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


@pytest.fixture(scope="module")
def tls_server(model: torch.nn.Module, pki: Pki) -> Iterator[RunningServer]:
    tls = load_server_tls(str(pki.server_cert), str(pki.server_key))
    running = loaded_server(model, tokenizer=ByteTokenizer(), tls=tls)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def mtls_server(model: torch.nn.Module, pki: Pki) -> Iterator[RunningServer]:
    tls = load_server_tls(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    running = loaded_server(model, tokenizer=ByteTokenizer(), tls=tls)
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
    stranger_ca = make_certificate("stranger CA", stranger_ca_key, None)
    stranger = make_certificate(
        "stranger", stranger_key, (stranger_ca, stranger_ca_key), usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    cert = write_pem(tmp_path, "stranger", stranger, stranger_key)
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
