"""Certificates for the TLS tests, made with `cryptography`: a CA, a server certificate it signs for 127.0.0.1 and
localhost, and a client certificate it signs (for mutual TLS)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    elif server:
        builder = (builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path) -> Pki:
    """A CA and the server and client certificates it signs, as PEM files in `folder`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("sarathi test CA", ca_key, _name("sarathi test CA"), ca_key, ca=True)
    paths: dict[str, str] = {}
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"sarathi test {who}", key, ca.subject, ca_key, server=who == "server")
        (folder / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}_cert"] = str(folder / f"{who}.pem")
        paths[f"{who}_key"] = _write_key(key, folder / f"{who}-key.pem")
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return Pki(ca_cert=str(folder / "ca.pem"), **paths)
