#!/usr/bin/env python3
"""Generate turnpoint.v1 Python code from proto/ (messages, gRPC stubs, typed stubs).

    python scripts/gen_proto.py            # regenerate into turnpoint/v1/
    python scripts/gen_proto.py --check    # fail if the committed code is stale

The generated code is committed so that `pip install .` needs no protoc and editors
and mypy see typed stubs from a fresh clone; CI runs --check so that it never drifts
from the .proto files.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("turnpoint") / "v1"
HAND_WRITTEN = {"__init__.py", "py.typed"}


def _protos() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def _plugin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        sys.exit(f"gen_proto: {name} not found; install the dev extra (mypy-protobuf)")
    return found


def generate(out: Path) -> None:
    from grpc_tools import protoc  # dev dependency, imported lazily

    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in _protos()],
    ]
    code = protoc.main(args)
    if code != 0:
        sys.exit(f"gen_proto: protoc failed with exit code {code}")


def _generated_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_file() and p.name not in HAND_WRITTEN}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh = out / PACKAGE_DIR
        committed = ROOT / "core" / "src" / PACKAGE_DIR
        if args.check:
            names = _generated_files(fresh) | _generated_files(committed)
            stale = sorted(
                n
                for n in names
                if not (fresh / n).exists()
                or not (committed / n).exists()
                or not filecmp.cmp(fresh / n, committed / n, shallow=False)
            )
            if stale:
                print("gen_proto: generated code is stale: " + ", ".join(stale))
                print("gen_proto: run `python scripts/gen_proto.py` and commit the result")
                return 1
            print(f"gen_proto: {len(names)} generated files up to date")
            return 0
        committed.mkdir(parents=True, exist_ok=True)
        for name in _generated_files(committed):
            (committed / name).unlink()
        for path in fresh.iterdir():
            if path.is_file():
                shutil.copyfile(path, committed / path.name)
        print(f"gen_proto: wrote {len(_generated_files(committed))} files to {committed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
