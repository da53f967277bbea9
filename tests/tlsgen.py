"""Throw-away PKI for TLS/mTLS tests: a CA, a server cert for 127.0.0.1/localhost, a client cert.

Why the ``openssl`` CLI: it is on every CI image we use, and it keeps the ``cryptography``
package out of our test dependencies. Keys are EC P-256: generated in milliseconds, where RSA
keys would cost a noticeable share of a fast test.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {res.stderr.strip()}")


def _leaf(folder: Path, name: str, subject: str, ext: str) -> None:
    """Key + CSR + cert signed by the CA in ``folder``, with the extensions in ``ext``."""
    (folder / f"{name}.ext").write_text(ext)
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        subject,
        cwd=folder,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-sha256",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=folder,
    )


def generate(folder: str | Path) -> TlsFiles:
    """Write ca.crt, server.{crt,key}, client.{crt,key} into ``folder`` (created if missing).

    The server cert carries both serverAuth and clientAuth (as etcd's own tooling does), so a
    LocalEtcd with client-cert auth can probe itself with it; the client cert is clientAuth only.
    """
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed to generate test certificates")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=etcdrun-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )
    _leaf(
        folder,
        "server",
        "/CN=localhost",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature\n",
    )
    _leaf(
        folder,
        "client",
        "/CN=etcdrun-test-client",
        "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n",
    )
    return TlsFiles(
        ca_file=str(folder / "ca.crt"),
        server_cert=str(folder / "server.crt"),
        server_key=str(folder / "server.key"),
        client_cert=str(folder / "client.crt"),
        client_key=str(folder / "client.key"),
    )
