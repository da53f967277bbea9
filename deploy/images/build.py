#!/usr/bin/env python3
"""Build the ``etcdrun/etcd`` and ``etcdrun/agent`` images from local material, by one command.

Why this way: there may be no registry where etcdrun is built (there is none on its CI machine),
so every base is made here (see rootfs.py) and every wheel is downloaded or built on the host
and installed in the image with ``pip --no-index``. Each image is tagged with a key derived
from its inputs (base image id, Dockerfile, etcdrun's sources, examples); a tag that exists
is not built again, so a second run, or every test of one CI run, costs only the hashing (~0.3 s).
``:latest`` is moved to the keyed tag at the end, for docker-compose.yml's defaults.

Where a registry exists, start from the usual images instead (the Dockerfiles take ``BASE``)::

    python3 deploy/images/build.py --agent-base python:3.11-slim \
        --etcd-base gcr.io/etcd-development/etcd:v3.5.17

Measured here (2 cores): cold 117 s (debootstrap 88 s, wheels 12 s, agent build 12 s), cached
0.25 s; etcdrun/etcd 41 MB, etcdrun/agent 168 MB (its Debian base 123 MB). ``--json`` prints
the tags for scripts (tests/compose_helpers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rootfs  # noqa: E402  (the sibling module, found through the line above)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PACKAGE_DIRS = ("agent", "rendezvous", "proto")  # what goes into etcdrun's wheel
TORCH = "torch==2.13.0+cpu"  # the CPU build, from this machine's disk (pip's find-links)
LABEL = "org.etcdrun.content-key"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def docker(*args: str, check: bool = True, quiet: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=quiet, text=True)
    if check and proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-20:])
        raise SystemExit(f"build: docker {args[0]} failed ({proc.returncode}):\n{tail}")
    return proc


def image_id(ref: str) -> str | None:
    proc = docker("image", "inspect", "-f", "{{.Id}}", ref, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def cached(tag: str, what: str) -> bool:
    if image_id(tag) is None:
        log(f"{tag}: building {what}")
        return False
    log(f"{tag}: up to date ({what})")
    return True


def docker_build(tag: str, dockerfile: Path, context: Path, base: str, key: str) -> None:
    t0 = time.monotonic()
    docker(
        "build",
        "--build-arg",
        f"BASE={base}",
        "--label",
        f"{LABEL}={key}",
        "-f",
        str(dockerfile),
        "-t",
        tag,
        str(context),
    )
    log(f"{tag}: built in {time.monotonic() - t0:.1f} s")


def base_ref(base: str) -> str:
    """What a key says about a base: its image id when local (a registry base not pulled yet
    is named by its reference: a moved tag there is seen only once pulled).
    """
    return image_id(base) or base


# ---- etcd --------------------------------------------------------------------------------------
def etcd_image(args: argparse.Namespace) -> str:
    base = args.etcd_base
    if base is None:
        files = rootfs.etcd_rootfs_files(*rootfs.find_etcd(args.etcd_bin))
        base = f"etcdrun/etcd-rootfs:{rootfs.etcd_rootfs_key(files)}"
        names = ", ".join(Path(n).name for n in files)
        if not cached(base, f"docker import of {names}"):
            with tempfile.TemporaryDirectory() as tmp:
                tar = Path(tmp) / "rootfs.tar"
                rootfs.write_etcd_rootfs(files, tar)
                docker(
                    "import", "--change", "ENV PATH=/usr/local/bin:/usr/bin:/bin", str(tar), base
                )
    dockerfile = HERE / "etcd.Dockerfile"
    key = rootfs.digest("etcd-1", base_ref(base), dockerfile.read_bytes())
    tag = f"etcdrun/etcd:{key}"
    if not cached(tag, f"etcd.Dockerfile FROM {base}"):
        with tempfile.TemporaryDirectory() as ctx:
            docker_build(tag, dockerfile, Path(ctx), base, key)
    docker("tag", tag, "etcdrun/etcd:latest")
    return tag


# ---- agent -------------------------------------------------------------------------------------
def debian_base(args: argparse.Namespace) -> str:
    suite = args.suite or rootfs.host_codename()
    mirror = args.mirror or rootfs.host_mirror(suite)
    key = rootfs.debian_key(suite, mirror)
    tag = f"etcdrun/debian:{suite}-{key}"
    if cached(tag, f"debootstrap {suite} from {mirror} (python3)"):
        return tag
    tarball = args.cache / f"debian-{suite}-{key}.tar.gz"
    if tarball.exists():
        log(f"  rootfs tarball cached: {tarball}")
    else:
        t0 = time.monotonic()
        rootfs.debootstrap_tarball(suite, mirror, tarball, log)
        log(f"  debootstrap: {time.monotonic() - t0:.1f} s -> {tarball}")
    docker("import", "--change", 'CMD ["python3"]', str(tarball), tag)
    return tag


def python_version(base: str, cache: Path) -> str:
    """The base image's python3 as 'X.Y' (the deps' wheels must match it), cached per image."""
    memo = cache / f"python-{base_ref(base).replace(':', '-')}"
    if memo.exists():
        return memo.read_text().strip()
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    out = docker("run", "--rm", "--entrypoint", "python3", base, "-c", code).stdout.strip()
    memo.write_text(out)
    return out


def source_key() -> str:
    parts = [(REPO / "pyproject.toml").read_bytes()]
    for d in PACKAGE_DIRS:
        for p in sorted((REPO / d).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".pyi", ".proto"):
                parts += [str(p.relative_to(REPO)), p.read_bytes()]
    return rootfs.digest("etcdrun-src-1", *parts)


def wheels(pyver: str, torch: bool, out: Path) -> None:
    """etcdrun's wheel and its dependencies' wheels for the image's Python, into ``out``."""
    t0 = time.monotonic()
    arch = platform.machine()
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(out), str(REPO)], check=True)
    wheel = next(out.glob("etcdrun-*.whl"))
    tags = [f"--platform=manylinux_2_{n}_{arch}" for n in (28, 17)]
    tags.append(f"--platform=manylinux2014_{arch}")
    only = ["--only-binary=:all:", f"--python-version={pyver}", "--implementation=cp", *tags]
    extra = [TORCH] if torch else []
    subprocess.run([*pip, "download", *only, "-d", str(out), str(wheel), *extra], check=True)
    names = sorted(p.name for p in out.iterdir())
    log(f"  wheels for Python {pyver} ({time.monotonic() - t0:.1f} s): {', '.join(names)}")


def agent_image(args: argparse.Namespace) -> str:
    """Keyed by what goes in (base, Dockerfile, etcdrun's sources, Python, torch, examples),
    not by the wheels: a wheel built again in a fresh clone differs in its timestamps alone, and
    a hit must not need pip at all. Dependency versions are fixed when the image is built
    (pyproject's bounds are part of the key).
    """
    base = args.agent_base or debian_base(args)
    pyver = python_version(base, args.cache)
    examples = sorted((REPO / "examples").glob("*.py"))
    dockerfile = HERE / "agent.Dockerfile"
    key = rootfs.digest(
        "agent-2",
        base_ref(base),
        dockerfile.read_bytes(),
        source_key(),
        pyver,
        platform.machine(),
        str(args.torch),
        *(f"{p.name}:{rootfs.file_sha(p)}" for p in examples),
    )
    repo = "etcdrun/agent-torch" if args.torch else "etcdrun/agent"
    tag = f"{repo}:{key}"
    if not cached(tag, f"agent.Dockerfile FROM {base}, Python {pyver}"):
        with tempfile.TemporaryDirectory(dir=args.cache) as ctx:
            wheels(pyver, args.torch, Path(ctx) / "wheels")
            (Path(ctx) / "examples").mkdir()
            for p in examples:
                shutil.copy2(p, Path(ctx) / "examples" / p.name)
            docker_build(tag, dockerfile, Path(ctx), base, key)
    docker("tag", tag, f"{repo}:latest")
    return tag


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--etcd-base",
        help="base image for etcd (default: a rootfs of this "
        "machine's etcd, etcdctl and libc, made with docker import)",
    )
    p.add_argument(
        "--agent-base",
        help="base image with python3 (default: a Debian made "
        "by debootstrap from this machine's mirror), e.g. python:3.11-slim",
    )
    p.add_argument("--etcd-bin", help="the etcd binary to package (default: etcd on PATH)")
    p.add_argument("--suite", help="Debian suite for debootstrap (default: this host's)")
    p.add_argument("--mirror", help="Debian mirror (default: the one apt uses here)")
    p.add_argument("--torch", action="store_true", help=f"also install {TORCH} in the agent")
    p.add_argument(
        "--cache",
        type=Path,
        help="cache dir (default: $ETCDRUN_IMAGE_CACHE, else deploy/images/.cache; gitignored)",
    )
    p.add_argument("--json", action="store_true", help="print the tags as JSON on stdout")
    args = p.parse_args(argv)
    env_cache = os.environ.get("ETCDRUN_IMAGE_CACHE")
    args.cache = (args.cache or Path(env_cache or HERE / ".cache")).resolve()
    args.cache.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if shutil.which("docker") is None or docker("info", check=False).returncode != 0:
        log("build: no Docker engine answers `docker info` (start dockerd)")
        return 1
    t0 = time.monotonic()
    tags = {"etcd": etcd_image(args), "agent": agent_image(args)}
    log(f"done in {time.monotonic() - t0:.1f} s")
    if args.json:
        print(json.dumps(tags))
    else:
        for name, tag in tags.items():
            print(f"{name}: {tag} (also {tag.split(':')[0]}:latest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
