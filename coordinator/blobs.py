"""Files the coordinator keeps for jobs: uploaded blobs and jobs' outputs.

Blobs (``STATE_DIR/blobs/SHA256``) are what clients upload for a job before submitting it: a
``.keras`` model file (``model.keras_file``) or a packed ``code.dir``. They are stored by the
SHA-256 of their bytes, so a second upload of the same file costs nothing and a job names its
file by digest; agents fetch them by digest and check it. Outputs
(``STATE_DIR/outputs/JOB_ID/...``) are what a job's lead task produced (``model.keras``) and the
coordinator's ``metrics.json``, uploaded by the agent that ran the task, so ``strata download``
needs no shared file system.

Limits are the coordinator's (``--max-upload``): an upload over it is refused while it streams
and leaves nothing behind. Paths from the wire are checked: an output path is relative, without
``..``; a digest is 64 hex digits.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from typing import AsyncIterator, Iterable, Iterator

from strata.errors import NotFoundError, SpecError, UploadError
from strata.uploads import (  # noqa: F401 (re-exported)
    CHUNK_BYTES, MAX_KERAS_CONFIG_BYTES, SHA256_RE, file_chunks, keras_config, safe_relpath,
)

DEFAULT_MAX_UPLOAD_BYTES = 2 << 30       # a .keras file or a code archive
MAX_OUTPUT_FILE_BYTES = 64 << 30



def check_sha(sha: str, field: str = "sha256") -> str:
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise SpecError(field, f"must be a SHA-256 digest (64 lower-case hex digits), got "
                               f"{str(sha)[:80]!r}")
    return sha


class BlobStore:
    def __init__(self, state_dir: str, max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES):
        self.root = os.path.join(state_dir, "blobs")
        self.outputs_root = os.path.join(state_dir, "outputs")
        self.max_upload_bytes = int(max_upload_bytes)
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.outputs_root, exist_ok=True)

    # -- blobs

    def path(self, sha: str) -> str:
        return os.path.join(self.root, check_sha(sha))

    def exists(self, sha: str) -> bool:
        return os.path.isfile(self.path(sha))

    async def put(self, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        """Stores the streamed bytes; returns ``(sha256, size)``. Refuses more than
        ``max_upload_bytes`` as it streams."""
        h = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                async for data in chunks:
                    size += len(data)
                    if size > self.max_upload_bytes:
                        raise UploadError(f"upload is over the coordinator's limit of "
                                          f"{self.max_upload_bytes:,} bytes (--max-upload)")
                    h.update(data)
                    await asyncio.to_thread(f.write, data)  # a slow disk never stalls the loop
            sha = h.hexdigest()
            os.replace(tmp, os.path.join(self.root, sha))
            return sha, size
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def read(self, sha: str) -> Iterator[bytes]:
        path = self.path(sha)
        if not os.path.isfile(path):
            raise NotFoundError("blob", sha)
        yield from file_chunks(path)

    def size(self, sha: str) -> int:
        path = self.path(sha)
        if not os.path.isfile(path):
            raise NotFoundError("blob", sha)
        return os.path.getsize(path)

    def keras_config(self, sha: str, name: str) -> str:
        path = self.path(sha)
        if not os.path.isfile(path):
            raise SpecError("model.keras_file", f"{name} (sha256 {sha[:12]}) was not uploaded to "
                                                "this coordinator; submit through the client, "
                                                "which uploads it first")
        return keras_config(path, name)

    # -- outputs

    def output_dir(self, job_id: str) -> str:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise UploadError(f"bad job id {job_id[:100]!r}")
        return os.path.join(self.outputs_root, job_id)

    def output_path(self, job_id: str, relpath: str) -> str:
        """Where a job's output file goes (its directory made); the path stays inside it."""
        path = os.path.join(self.output_dir(job_id), safe_relpath(relpath))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    async def put_output(self, job_id: str, relpath: str, chunks: AsyncIterator[bytes],
                         limit: int) -> int:
        """Stores one output file from its streamed chunks; returns its size. Written under a
        temporary name and renamed when whole, so a broken upload leaves no partial file."""
        path = self.output_path(job_id, relpath)
        tmp = f"{path}.part"
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for data in chunks:
                    size += len(data)
                    if size > limit:
                        raise UploadError(f"output file {relpath!r} is over {limit:,} bytes")
                    await asyncio.to_thread(f.write, data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size

    def write_output(self, job_id: str, relpath: str, data: bytes) -> None:
        path = self.output_path(job_id, relpath)
        with open(f"{path}.part", "wb") as f:
            f.write(data)
        os.replace(f"{path}.part", path)

    def outputs(self, job_id: str) -> list[str]:
        """The job's output files, relative paths, sorted."""
        root = self.output_dir(job_id)
        out = []
        for base, _dirs, files in os.walk(root):
            for name in files:
                if not name.endswith(".part"):  # still arriving
                    out.append(os.path.relpath(os.path.join(base, name), root))
        return sorted(out)

    def read_outputs(self, job_id: str) -> Iterable[tuple[str, int, int, bytes]]:
        """``(path, offset, size, data)`` chunks of every output file of the job."""
        root = self.output_dir(job_id)
        for rel in self.outputs(job_id):
            path = os.path.join(root, rel)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                offset = 0
                while True:
                    data = f.read(CHUNK_BYTES)
                    if not data and offset:
                        break
                    yield rel, offset, size, data
                    offset += len(data)
                    if not data:
                        break

    def delete_outputs(self, job_id: str) -> None:
        shutil.rmtree(self.output_dir(job_id), ignore_errors=True)
