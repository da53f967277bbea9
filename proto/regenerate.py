"""Regenerate the ``*_pb2.py`` modules of etcdrun.proto from the ``.proto`` sources.

Why pinned: the generated code must run on every protobuf from 5.27 to 7.x. Output of
grpcio-tools 1.66.x does (measured); newer generators stamp a newer gencode version that older
runtimes refuse. The generator is installed with ``--no-deps`` into a private cache folder so that
it never downgrades the protobuf runtime of the environment it runs in.

Why a temporary tree: protoc names each file in the descriptor pool by its path under the include
root. Generating from ``<tmp>/etcdrun/proto/x.proto`` makes that name ``etcdrun/proto/x.proto``,
which cannot clash with another library's ``rpc.proto`` loaded in the same process.

Usage: ``python proto/regenerate.py [--check]`` (``--check`` compares instead of writing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GRPC_TOOLS_VERSION = "1.66.2"
PROTO_DIR = Path(__file__).resolve().parent
SOURCES = sorted(p.name for p in PROTO_DIR.glob("*.proto"))


def _tools_path() -> Path:
    """Return a folder holding the pinned grpc_tools, installing it there on first use."""
    cache = Path(os.environ.get("ETCDRUN_PROTOC_CACHE", PROTO_DIR.parent / ".cache"))
    target = cache / f"grpcio-tools-{GRPC_TOOLS_VERSION}"
    if not (target / "grpc_tools" / "protoc.py").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(target),
                f"grpcio-tools=={GRPC_TOOLS_VERSION}",
            ],
            check=True,
        )
    return target


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every source and return the generated files, written to ``out_dir``."""
    tools = _tools_path()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pkg = root / "etcdrun" / "proto"
        pkg.mkdir(parents=True)
        for name in SOURCES:
            shutil.copy(PROTO_DIR / name, pkg / name)
        out = root / "out"
        out.mkdir()
        code = (
            "import sys; from grpc_tools import protoc; "
            "sys.exit(protoc.main(['protoc'] + sys.argv[1:]))"
        )
        args = [f"-I{root}", f"--python_out={out}", f"--pyi_out={out}"]
        args += [f"etcdrun/proto/{name}" for name in SOURCES]
        env = dict(os.environ, PYTHONPATH=str(tools))
        subprocess.run([sys.executable, "-c", code, *args], check=True, env=env, cwd=root)
        written = []
        for f in sorted((out / "etcdrun" / "proto").iterdir()):
            dest = out_dir / f.name
            shutil.copy(f, dest)
            written.append(dest)
        return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    opts = parser.parse_args(argv)
    if not opts.check:
        for path in generate(PROTO_DIR):
            print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            p.name
            for p in generate(Path(tmp))
            if not (PROTO_DIR / p.name).exists()
            or (PROTO_DIR / p.name).read_bytes() != p.read_bytes()
        ]
    if stale:
        print("stale generated files: " + ", ".join(stale), file=sys.stderr)
        return 1
    print("generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
