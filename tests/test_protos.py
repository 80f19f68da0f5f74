"""The checked-in generated gRPC code matches the .proto files."""

import subprocess
import sys
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_current():
    r = subprocess.run([sys.executable, "-m", "strata.protos.codegen", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_generated_imports_are_package_relative():
    text = (ROOT / "protos" / "strata_pb2_grpc.py").read_text()
    assert "from strata.protos import strata_pb2" in text
