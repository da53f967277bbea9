"""Base root filesystems for the images, made from this machine's own files and package mirror.

Why not ``FROM debian`` / the official etcd image: where etcdrun is built and tested there is no
container registry, so nothing can be pulled. Two bases are made locally instead, each imported
with ``docker import``:

- etcd: Debian's ``etcd`` and ``etcdctl`` binaries (they link only libc), libc.so.6 and ld.so,
  laid out as the official image does (``/usr/local/bin``): 5 files, a 41 MB image, healthy
  ~3 s after start. The tar is written deterministically (mtime 0, root-owned), so its hash is
  the hash of its content.
- agent: a Debian ``minbase`` made by ``debootstrap`` (python3, python3-venv) from the mirror apt
  is configured with, trimmed of apt lists, .debs, docs and locales. debootstrap is slow
  (~90 s here) and its output is not reproducible, so the tarball is cached; the key is what it
  was made from (suite, mirror, variant, packages).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

DEBIAN_PACKAGES = ("python3", "python3-venv")
TRIM = (
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/info",
)
NSSWITCH = b"passwd: files\ngroup: files\nhosts: files dns\n"


def digest(*parts: bytes | str) -> str:
    """A short content key: 16 hex digits of sha256 over the parts (length-prefixed)."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "big") + b)
    return h.hexdigest()[:16]


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- etcd ------------------------------------------------------------------------------------
def find_etcd(etcd: str | None) -> tuple[Path, Path]:
    """(etcd, etcdctl) on this machine: ``etcd`` argument, else PATH, else /usr/bin."""
    found = etcd or shutil.which("etcd") or "/usr/bin/etcd"
    etcd_path = Path(found).resolve()
    ctl = etcd_path.with_name("etcdctl")
    for p in (etcd_path, ctl):
        if not p.is_file():
            raise SystemExit(
                f"build: {p} not found: install Debian's etcd-server and etcd-client "
                "(apt-get install etcd-server etcd-client) or give --etcd-bin"
            )
    return etcd_path, ctl


def shared_libs(binary: Path) -> list[Path]:
    """The libraries ``binary`` loads, as ldd names them (the path the loader looks at)."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    libs = []
    for line in out.splitlines():
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if m:
            libs.append(Path(m.group(1)))
    return libs


def etcd_rootfs_files(etcd: Path, etcdctl: Path) -> dict[str, Path]:
    """Archive name -> host file: the binaries in /usr/local/bin, libraries at ldd's paths."""
    files = {"usr/local/bin/etcd": etcd, "usr/local/bin/etcdctl": etcdctl}
    for binary in (etcd, etcdctl):
        for lib in shared_libs(binary):
            files[str(lib).lstrip("/")] = lib.resolve()
    return dict(sorted(files.items()))


def etcd_rootfs_key(files: dict[str, Path]) -> str:
    return digest("etcd-rootfs-1", NSSWITCH, *(f"{n}:{file_sha(p)}" for n, p in files.items()))


def write_etcd_rootfs(files: dict[str, Path], out: Path) -> None:
    """A deterministic tar: directories, the files, /etc/nsswitch.conf, an empty data dir."""
    dirs = {"etc", "tmp", "var", "var/lib", "var/lib/etcd"}
    for name in files:
        parts = name.split("/")[:-1]
        dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))

    def info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.size, ti.mtime = kind, mode, size, 0
        ti.uid = ti.gid = 0
        return ti

    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for d in sorted(dirs):
            mode = 0o1777 if d == "tmp" else 0o700 if d == "var/lib/etcd" else 0o755
            tar.addfile(info(d, tarfile.DIRTYPE, mode))
        tar.addfile(
            info("etc/nsswitch.conf", tarfile.REGTYPE, 0o644, len(NSSWITCH)), io.BytesIO(NSSWITCH)
        )
        for name, path in files.items():
            with open(path, "rb") as f:
                tar.addfile(info(name, tarfile.REGTYPE, 0o755, path.stat().st_size), f)


# ---- Debian ----------------------------------------------------------------------------------
def host_codename() -> str:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return "bookworm"
    m = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", text, re.M)
    return m.group(1) if m else "bookworm"


def host_mirror(suite: str) -> str:
    """The Debian mirror apt uses here (one-line or deb822 sources), else deb.debian.org."""
    candidates: list[tuple[str, list[str]]] = []
    lst = Path("/etc/apt/sources.list")
    if lst.is_file():
        for line in lst.read_text().splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
            if m:
                candidates.append((m.group(1), [m.group(2)]))
    for src in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in src.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(.+)$", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and re.search(r"^Types:.*\bdeb\b", stanza, re.M):
                candidates += [(u, suites.group(1).split()) for u in uris.group(1).split()]
    for uri, suites in candidates:
        if suite in suites and uri.rstrip("/").endswith("/debian"):
            return uri.rstrip("/")
    return "http://deb.debian.org/debian"


def debian_key(suite: str, mirror: str) -> str:
    return digest("debian-rootfs-1", suite, mirror, "minbase", *DEBIAN_PACKAGES, *TRIM)


def debootstrap_tarball(suite: str, mirror: str, out: Path, log) -> None:
    """debootstrap into a temporary folder, trim it, tar it to ``out``.

    The folder is in the system's temp dir, never beside ``out``: the default cache is in the
    source tree, and a rootfs under debootstrap has /proc mounted in it, which anything that
    walks the tree meanwhile (a test copying the repository, a linter) would read and hang on.
    """
    if shutil.which("debootstrap") is None:
        raise SystemExit(
            "build: debootstrap not found (apt-get install debootstrap), "
            "or give --agent-base IMAGE (e.g. python:3.11-slim)"
        )
    if os.geteuid() != 0:
        raise SystemExit("build: debootstrap needs root; or give --agent-base IMAGE")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="etcdrun-debootstrap-"))
    try:
        root = work / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            "--include=" + ",".join(DEBIAN_PACKAGES),
            suite,
            str(root),
            mirror,
        ]
        log(f"  + {' '.join(cmd)}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise SystemExit(f"build: debootstrap failed ({proc.returncode}):\n{tail}")
        for rel in TRIM:
            target = root / rel
            if target.is_dir():
                shutil.rmtree(target)
                target.mkdir()
        tmp = out.with_suffix(".partial")
        subprocess.run(
            [
                "tar",
                "--numeric-owner",
                "--exclude=./dev/*",
                "--exclude=./proc/*",
                "--exclude=./sys/*",
                "-C",
                str(root),
                "-czf",
                str(tmp),
                ".",
            ],
            check=True,
        )
        tmp.rename(out)  # atomic: a concurrent or interrupted build never sees half a tarball
    finally:
        shutil.rmtree(work, ignore_errors=True)
