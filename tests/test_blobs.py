"""The coordinator's files (pure: no processes): uploads stored by digest and refused over the
limit, outputs written whole or not at all and never outside the job's directory, .keras files
checked before anything reads them, code directories packed the same way twice."""

from __future__ import annotations

import asyncio
import hashlib
import os
import tarfile
import zipfile

import pytest

from strata.coordinator.blobs import BlobStore
from strata.errors import SpecError, UploadError
from strata.uploads import keras_config, pack_dir, safe_relpath


async def _chunks(parts):
    for p in parts:
        yield p


def test_blob_is_stored_by_its_digest_and_refused_over_the_limit(tmp_path):
    store = BlobStore(str(tmp_path), max_upload_bytes=10)
    sha, size = asyncio.run(store.put(_chunks([b"hello", b"!"])))
    assert sha == hashlib.sha256(b"hello!").hexdigest() and size == 6
    assert b"".join(store.read(sha)) == b"hello!" and store.exists(sha)
    with pytest.raises(UploadError, match="--max-upload"):
        asyncio.run(store.put(_chunks([b"123456", b"789012"])))
    assert sorted(os.listdir(store.root)) == [sha]  # nothing left of the refused upload


def test_outputs_are_whole_and_inside_the_job_directory(tmp_path):
    store = BlobStore(str(tmp_path))

    async def broken():
        yield b"half"
        raise ConnectionError("agent went away")

    with pytest.raises(ConnectionError):
        asyncio.run(store.put_output("job-1", "model.keras", broken(), 1 << 20))
    assert store.outputs("job-1") == []
    asyncio.run(store.put_output("job-1", "sub/model.keras", _chunks([b"ab", b"cd"]), 1 << 20))
    store.write_output("job-1", "metrics.json", b"{}")
    assert store.outputs("job-1") == ["metrics.json", "sub/model.keras"]
    got = {}
    for path, _offset, _size, data in store.read_outputs("job-1"):
        got[path] = got.get(path, b"") + data
    assert got == {"metrics.json": b"{}", "sub/model.keras": b"abcd"}
    for bad in ("../escape", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(UploadError):
            safe_relpath(bad)
    with pytest.raises(UploadError):
        store.output_dir("../other")


def test_keras_file_checks(tmp_path):
    not_zip = tmp_path / "x.keras"
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(SpecError, match="not a .keras file"):
        keras_config(str(not_zip))
    no_weights = tmp_path / "y.keras"
    with zipfile.ZipFile(no_weights, "w") as z:
        z.writestr("config.json", "{}")
    with pytest.raises(SpecError, match="model.weights.h5"):
        keras_config(str(no_weights))


def test_code_dir_packs_the_same_bytes_twice_and_leaves_caches_out(tmp_path):
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "train.py").write_text("x = 1\n")
    (proj / "pkg" / "util.py").write_text("y = 2\n")
    (proj / "__pycache__").mkdir()
    (proj / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (proj / ".git").mkdir()
    (proj / ".git" / "HEAD").write_text("ref")
    a, b = pack_dir(str(proj)), pack_dir(str(proj))
    try:
        assert open(a, "rb").read() == open(b, "rb").read()
        with tarfile.open(a) as t:
            assert sorted(t.getnames()) == ["pkg/util.py", "train.py"]
    finally:
        os.unlink(a)
        os.unlink(b)
