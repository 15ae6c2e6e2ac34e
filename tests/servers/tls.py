"""An ``https://`` front for a plain-HTTP server on 127.0.0.1: TLS in, the same bytes out.

Production S3 is reached over ``https://``, where botocore signs and checksums bodies
differently than over ``http://`` (moto and the local gateways speak plain HTTP).
``TlsFront(upstream).start()`` listens on 127.0.0.1 with a self-signed certificate made for this
run (``cryptography``, which moto brings), passes every connection's decrypted bytes to
``upstream`` and back, and gives the ``endpoint_url`` and the ``ca_file`` a client verifies
the certificate with (``client_kwargs={"endpoint_url": …, "verify": ca_file}``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile

from tests.servers.proxy import LoopbackProxy


def _self_signed(folder: str) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1, valid for a day, written under ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = os.path.join(folder, "key.pem"), os.path.join(folder, "cert.pem")
    with open(key_file, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    with open(cert_file, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


class TlsFront(LoopbackProxy):
    """``https://127.0.0.1:<port>`` in front of ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="dcp-fsspec-tls-")
        key_file, self.ca_file = _self_signed(self._folder.name)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.ca_file, key_file)
        super().__init__(upstream, tls=context)

    def start(self) -> TlsFront:
        super().start()
        return self

    def stop(self) -> None:
        """Close every connection, then remove the certificate."""
        super().stop()
        self._folder.cleanup()

    def __enter__(self) -> TlsFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
