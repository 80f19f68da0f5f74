"""Generates the Python gRPC code for every .proto in protos/ (the one place it is made).

Run from anywhere: ``python -m strata.protos.codegen`` (or ``make protos``). Output lands beside
the .proto files and imports as ``from strata.protos import strata_pb2``: the directory is
installed as the package ``strata.protos``, so protoc runs on a staging copy laid out as
``strata/protos/*.proto`` (generated imports follow the proto's path under the ``-I`` root).
``--check`` regenerates into a temporary directory and exits 1 when the checked-in files differ,
which ``tests/test_protos.py`` uses so stale generated code fails the suite.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
PACKAGE_PATH = pathlib.Path("strata") / "protos"   # where the package lives once installed
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Generates into ``out_dir`` (flat); returns the files made."""
    from grpc_tools import protoc  # imported lazily: only code generation needs grpcio-tools

    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        stage = pathlib.Path(tmp) / "src"
        made = pathlib.Path(tmp) / "out"
        (stage / PACKAGE_PATH).mkdir(parents=True)
        made.mkdir()
        rels = []
        for p in proto_files():
            shutil.copy(p, stage / PACKAGE_PATH / p.name)
            rels.append(str(PACKAGE_PATH / p.name))
        args = ["protoc", f"-I{stage}", f"-I{well_known}", f"--python_out={made}",
                f"--pyi_out={made}", f"--grpc_python_out={made}", *rels]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        produced = []
        for p in proto_files():
            for suffix in SUFFIXES:
                name = p.stem + suffix
                shutil.copy(made / PACKAGE_PATH / name, out_dir / name)
                produced.append(out_dir / name)
    return produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if checked-in code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(PROTO_DIR)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(pathlib.Path(tmp)):
            checked_in = PROTO_DIR / path.name
            if not checked_in.exists() or not filecmp.cmp(path, checked_in, shallow=False):
                stale.append(str(checked_in.relative_to(ROOT)))
        if stale:
            print("stale generated code (run `make protos`): " + ", ".join(stale), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
