"""TLS and mutual TLS for both ports, from PEM files named on the command line.

`--tls-cert` and `--tls-key` (given together) make both the generation and the admin port TLS-only;
`--tls-client-ca` adds mutual TLS: every client must present a certificate signed by that CA.
Configuration mistakes are reported up front as a TlsConfigError naming the flag at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

CERT_FLAG = "--tls-cert"
KEY_FLAG = "--tls-key"
CLIENT_CA_FLAG = "--tls-client-ca"
_PEM_MARKER = b"-----BEGIN "


class TlsConfigError(ValueError):
    """A TLS flag is missing, names a file that cannot be read, or a file is not PEM."""


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate chain and private key (PEM), plus the CA bundle that client certificates
    must chain to when mutual TLS is on."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.mutual,
        )


def read_pem(path: str, flag: str) -> bytes:
    """The contents of the PEM file `path`; a TlsConfigError naming `flag` when it is unusable."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise TlsConfigError(f"{flag}: file not found: {path}") from None
    except OSError as exc:
        raise TlsConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if _PEM_MARKER not in data:
        raise TlsConfigError(f"{flag}: {path} is not a PEM file")
    return data


def load_server_tls(cert: str | None, key: str | None, client_ca: str | None = None) -> ServerTls | None:
    """The TLS settings of the flags, or None (plaintext ports) when no TLS flag is given."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError(
                f"{CLIENT_CA_FLAG} needs {CERT_FLAG} and {KEY_FLAG} (the server's certificate)"
            )
        return None
    if cert is None:
        raise TlsConfigError(f"{CERT_FLAG} is required with {KEY_FLAG}")
    if key is None:
        raise TlsConfigError(f"{KEY_FLAG} is required with {CERT_FLAG}")
    return ServerTls(
        certificate_chain=read_pem(cert, CERT_FLAG),
        private_key=read_pem(key, KEY_FLAG),
        client_ca=None if client_ca is None else read_pem(client_ca, CLIENT_CA_FLAG),
    )


def client_credentials(
    root_ca: str | None = None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """Channel credentials of a client: trust `root_ca` (else the system roots) and, for mutual TLS,
    present the certificate `cert` with its key `key` (the flags of `cbserve generate`)."""
    if (cert is None) != (key is None):
        raise TlsConfigError(f"{CERT_FLAG} and {KEY_FLAG} must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=None if root_ca is None else read_pem(root_ca, "--tls-ca"),
        private_key=None if key is None else read_pem(key, KEY_FLAG),
        certificate_chain=None if cert is None else read_pem(cert, CERT_FLAG),
    )
