"""Generates the Python gRPC code for every .proto in protos/ (the one place it is made).

Run from anywhere: ``python -m protos.codegen`` (or ``make protos``). Output lands beside the
.proto files and imports as ``from protos import strata_pb2``. ``--check`` regenerates into a
temporary directory and exits 1 when the checked-in files differ, which ``tests/test_protos.py``
uses so stale generated code fails the suite.
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


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc with ``-I<repo root>`` so generated imports read ``from protos import x_pb2``."""
    from grpc_tools import protoc  # imported lazily: only code generation needs grpcio-tools

    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rels = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *rels,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    produced = []
    for rel in rels:
        stem = pathlib.Path(rel).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            produced.append(out_root / f"{stem}{suffix}")
    return produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if checked-in code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(pathlib.Path(tmp)):
            checked_in = ROOT / path.relative_to(tmp)
            if not checked_in.exists() or not filecmp.cmp(path, checked_in, shallow=False):
                stale.append(str(checked_in.relative_to(ROOT)))
        if stale:
            print("stale generated code (run `make protos`): " + ", ".join(stale), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
