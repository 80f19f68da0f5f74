"""Files the coordinator keeps for jobs: uploaded blobs and jobs' outputs, accounted and bounded.

Blobs (``STATE_DIR/blobs/SHA256``) are what clients upload for a job before submitting it: a
``.keras`` model file (``model.keras_file``) or a packed ``code.dir``. They are stored by the
SHA-256 of their bytes, so a second upload of the same file costs no disk and a job names its
file by digest; agents fetch them by digest and check it. Outputs
(``STATE_DIR/outputs/JOB_ID/...``) are what a job's lead task produced (``model.keras``,
``tensorboard/``) and the coordinator's ``metrics.json``, uploaded by the agent that ran the
task, so ``strata download`` needs no shared file system.

Every byte has an owner and a bound:

- **Who holds a blob.** Each user who uploaded a blob, or submitted a job that names it, holds
  it (a row ``(sha, owner, size, time)``, kept in the store) and is charged its size, once
  however often it is uploaded. A holding ends when none of that owner's jobs names the blob
  and it is older than ``blob_grace_s`` (the time between an upload and its submit); a blob
  nobody holds and no job names is deleted (``collect``).
- **Quotas.** A user's stored bytes are the blobs it holds, its jobs' outputs and its jobs'
  logs (``charge_logs``, for ``coordinator.logs``); past ``user_quota`` (``--user-quota``)
  uploads and outputs are refused with ``QuotaExceeded`` (RESOURCE_EXHAUSTED) and logs are
  cut. Uploads still streaming count too, so parallel uploads cannot run past it. One job's
  outputs are at most ``max_job_outputs`` (``--max-job-outputs``). Refused while the bytes
  stream, and nothing is left behind.
- **The disk.** Every chunk is checked against the disk's reserve (``coordinator.disk``):
  a full disk is ``DiskFull`` (UNAVAILABLE), never a half-written file.

Paths from the wire are checked: an output path is relative, without ``..``; a digest is 64
hex digits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import time
from typing import AsyncIterator, Callable, Iterable, Iterator

from strata.coordinator.disk import DiskGuard, is_full
from strata.errors import NotFoundError, QuotaExceeded, SpecError, UploadError
from strata.units import format_size
from strata.uploads import (  # noqa: F401 (re-exported)
    CHUNK_BYTES, MAX_KERAS_CONFIG_BYTES, SHA256_RE, file_chunks, keras_config, safe_relpath,
)

log = logging.getLogger("strata.coordinator")

DEFAULT_MAX_UPLOAD_BYTES = 2 << 30       # a .keras file or a code archive
MAX_OUTPUT_FILE_BYTES = 64 << 30
#: a user's uploads and outputs together (``--user-quota``; 0: no quota): a hundred trained
#: ResNet50s (~100 MB each) with their code, the week of results --retention keeps by default
DEFAULT_USER_QUOTA_BYTES = 20 << 30
#: one job's outputs (``--max-job-outputs``): a model of a few GiB and its TensorBoard logs
DEFAULT_MAX_JOB_OUTPUTS_BYTES = 8 << 30
#: how long an upload is held before a job names it (a client uploads, then submits at once;
#: a job refused at submit leaves its upload for this long so a corrected submit reuses it)
DEFAULT_BLOB_GRACE_S = 3600.0
#: the coordinator's temporary files among a job's outputs (an upload still arriving)
TMP_PREFIX = ".strata-part-"


def check_sha(sha: str, field: str = "sha256") -> str:
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise SpecError(field, f"must be a SHA-256 digest (64 lower-case hex digits), got "
                               f"{str(sha)[:80]!r}")
    return sha


@dataclasses.dataclass(frozen=True)
class Holding:
    """One owner's hold on one blob: charged ``size`` bytes since ``since``."""

    size: int
    since: float


class BlobStore:
    def __init__(self, state_dir: str, max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES, *,
                 disk: DiskGuard | None = None, user_quota: int = 0,
                 max_job_outputs: int = DEFAULT_MAX_JOB_OUTPUTS_BYTES,
                 blob_grace_s: float = DEFAULT_BLOB_GRACE_S,
                 on_hold: Callable[[str, str, int, float], None] | None = None,
                 on_release: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.root = os.path.join(state_dir, "blobs")
        self.outputs_root = os.path.join(state_dir, "outputs")
        self.max_upload_bytes = int(max_upload_bytes)
        self.disk = disk
        self.user_quota = int(user_quota)
        self.max_job_outputs = int(max_job_outputs)
        self.blob_grace_s = blob_grace_s
        #: write-through of holdings (the coordinator's store)
        self._on_hold = on_hold
        self._on_release = on_release
        self.clock = clock
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.outputs_root, exist_ok=True)
        #: sha -> owner -> its holding; sha -> job id -> the job's owner (the jobs naming it)
        self._held: dict[str, dict[str, Holding]] = {}
        self._refs: dict[str, dict[str, str]] = {}
        #: job id -> relative path -> bytes, and each job's owner (the outputs on disk)
        self._outputs: dict[str, dict[str, int]] = {}
        self._output_owner: dict[str, str] = {}
        #: job id -> (its owner, bytes of its logs)
        self._logs: dict[str, tuple[str, int]] = {}
        #: owner -> bytes charged (blobs held + outputs + logs): kept as the above change
        self._usage: dict[str, int] = {}
        #: owner -> bytes of its uploads still streaming (not charged yet); job id -> bytes of
        #: its outputs still streaming
        self._inflight: dict[str, int] = {}
        self._inflight_out: dict[str, int] = {}
        #: sha -> its file's size, for every blob on disk
        self._sizes: dict[str, int] = {}

    def load(self, holdings: Iterable[tuple[str, str, int, float]],
             refs: Iterable[tuple[str, str, str]], owners: dict[str, str]) -> None:
        """The accounts as the store and the disk have them, at a coordinator's start:
        ``holdings`` (sha, owner, size, time), ``refs`` (job id, owner, sha) of the jobs held,
        ``owners`` job id -> owner. The owner of a job that names a blob holds it; blobs on
        disk nobody holds are given to no one (collected after the grace unless a job names
        them); holdings of a blob no longer on disk end; outputs of jobs no longer held and
        unfinished uploads are deleted."""
        now = self.clock()
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(".upload-"):
                _unlink(path)  # an upload cut short by a stop
            elif SHA256_RE.match(name) and os.path.isfile(path):
                self._sizes[name] = os.path.getsize(path)
        for sha, owner, _size, since in holdings:
            if sha in self._sizes:
                self._hold(sha, owner, since, write=False)
            elif self._on_release is not None:
                self._on_release(sha, owner)
        for job_id, owner, sha in refs:
            self._refs.setdefault(sha, {})[job_id] = owner
            if sha in self._sizes and owner not in self._held.get(sha, {}):
                self._hold(sha, owner, now)  # a job of a store older than holdings
        for sha in self._sizes:
            if sha not in self._held:
                self._hold(sha, "", now)
        for job_id in os.listdir(self.outputs_root):
            root = os.path.join(self.outputs_root, job_id)
            if job_id not in owners:
                shutil.rmtree(root, ignore_errors=True)  # its job was deleted meanwhile
                continue
            for rel in self._files(root):
                try:
                    self._count_output(job_id, owners[job_id], rel,
                                       os.path.getsize(os.path.join(root, rel)))
                except OSError:
                    pass

    # -- accounts

    def holds(self, sha: str, owner: str) -> bool:
        """Whether ``owner`` holds blob ``sha`` (uploaded it, or a job of its names it)."""
        return owner in self._held.get(sha, {})

    def usage(self, owner: str) -> int:
        """Bytes charged to ``owner``: the blobs it holds and its jobs' outputs."""
        return self._usage.get(owner, 0)

    def totals(self) -> tuple[int, int]:
        """Bytes on disk of blobs and of outputs."""
        return sum(self._sizes.values()), sum(sum(f.values()) for f in self._outputs.values())

    def _charge(self, owner: str, delta: int) -> None:
        left = self._usage.get(owner, 0) + delta
        if left > 0:
            self._usage[owner] = left
        else:
            self._usage.pop(owner, None)

    def _hold(self, sha: str, owner: str, since: float, write: bool = True) -> None:
        held = self._held.setdefault(sha, {})
        size = self._sizes.get(sha, 0)
        old = held.get(owner)
        if old is not None:
            self._charge(owner, -old.size)
        held[owner] = Holding(size, since)
        self._charge(owner, size)
        if write and self._on_hold is not None:
            self._on_hold(sha, owner, size, since)

    def _check_quota(self, owner: str, more: int, what: str) -> None:
        if self.user_quota and self.usage(owner) + more > self.user_quota:
            who = f"user {owner}" if owner else "the cluster's one user (no authentication)"
            raise QuotaExceeded(
                f"{what} would take {who} past the stored-bytes quota of "
                f"{format_size(self.user_quota)} (--user-quota): {format_size(self.usage(owner))} "
                "held in uploads and outputs; delete finished jobs (strata delete) to make room")

    def charge_logs(self, job_id: str, owner: str, size: int, force: bool = False) -> int:
        """How many of ``size`` more log bytes of ``owner``'s job fit its quota; those are
        charged (``coordinator.logs`` keeps them and drops the rest). ``force``: all of them
        (logs found on disk at a start)."""
        if self.user_quota and not force:
            size = max(0, min(size, self.user_quota - self.usage(owner)))
        held = self._logs.get(job_id, (owner, 0))[1]
        self._logs[job_id] = (owner, held + size)
        self._charge(owner, size)
        return size

    def forget_logs(self, job_id: str) -> None:
        owner, size = self._logs.pop(job_id, ("", 0))
        self._charge(owner, -size)

    def _check_disk(self, more: int, what: str) -> None:
        if self.disk is not None:
            self.disk.check(more, what)

    def attach(self, job_id: str, owner: str, shas: Iterable[str]) -> None:
        """A job names these blobs: its owner holds each (charged once per blob), and the
        blob is kept while the job is."""
        now = self.clock()
        for sha in shas:
            self._refs.setdefault(sha, {})[job_id] = owner
            held = self._held.get(sha, {})
            if owner not in held:
                self._hold(sha, owner, now)

    def detach(self, job_id: str, shas: Iterable[str]) -> None:
        """A job is deleted: it names its blobs no more (``collect`` deletes what nobody
        holds)."""
        for sha in shas:
            refs = self._refs.get(sha)
            if refs is not None:
                refs.pop(job_id, None)
                if not refs:
                    del self._refs[sha]

    def collect(self) -> tuple[int, int]:
        """Ends the holdings no job of their owner names and older than the grace, and deletes
        the blobs nobody holds and no job names. Returns (files deleted, bytes freed)."""
        now = self.clock()
        files = freed = 0
        for sha in list(self._held):
            named_by = set(self._refs.get(sha, {}).values())
            held = self._held[sha]
            for owner, h in list(held.items()):
                if owner not in named_by and now - h.since >= self.blob_grace_s:
                    del held[owner]
                    self._charge(owner, -h.size)
                    if self._on_release is not None:
                        self._on_release(sha, owner)
            if not held and sha not in self._refs:
                del self._held[sha]
                size = self._sizes.pop(sha, 0)
                _unlink(os.path.join(self.root, sha))
                files += 1
                freed += size
        return files, freed

    def check(self) -> None:
        """Asserts that the kept usage equals a recount of holdings, outputs and logs
        (tests)."""
        want: dict[str, int] = {}
        for held in self._held.values():
            for owner, h in held.items():
                want[owner] = want.get(owner, 0) + h.size
        for job_id, files in self._outputs.items():
            owner = self._output_owner[job_id]
            want[owner] = want.get(owner, 0) + sum(files.values())
        for owner, size in self._logs.values():
            want[owner] = want.get(owner, 0) + size
        assert {k: v for k, v in want.items() if v} == self._usage, (want, self._usage)

    # -- blobs

    def path(self, sha: str) -> str:
        return os.path.join(self.root, check_sha(sha))

    def exists(self, sha: str) -> bool:
        return os.path.isfile(self.path(sha))

    async def put(self, chunks: AsyncIterator[bytes], owner: str = "") -> tuple[str, int]:
        """Stores the streamed bytes for ``owner``; returns ``(sha256, size)``. Refuses, as it
        streams, more than ``max_upload_bytes`` and more than the disk's reserve leaves; once
        whole, a file the owner does not hold yet that its quota has no room for."""
        h = hashlib.sha256()
        size = counted = 0  # counted: this upload's bytes in ``_inflight``
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                async for data in chunks:
                    size += len(data)
                    if size > self.max_upload_bytes:
                        raise UploadError(f"upload is over the coordinator's limit of "
                                          f"{self.max_upload_bytes:,} bytes (--max-upload)")
                    if self.user_quota:
                        # the owner's other uploads streaming now count in full, this one once
                        # whole (a file it holds already costs nothing): uploads in parallel
                        # cannot run past the quota
                        others = self._inflight.get(owner, 0) - counted
                        self._check_quota(owner, others + (size if size > self.user_quota
                                                           else 0), "the upload")
                    self._inflight[owner] = self._inflight.get(owner, 0) + len(data)
                    counted += len(data)
                    self._check_disk(len(data), "the upload")
                    h.update(data)
                    await asyncio.to_thread(f.write, data)  # a slow disk never stalls the loop
            sha = h.hexdigest()
            if owner not in self._held.get(sha, {}):  # a file it holds already costs nothing
                self._check_quota(owner, size, "the upload")
            os.replace(tmp, os.path.join(self.root, sha))
            self._sizes[sha] = size
            self._hold(sha, owner, self.clock())  # held anew: the grace starts again
            return sha, size
        finally:
            left = self._inflight.get(owner, 0) - counted
            if left > 0:
                self._inflight[owner] = left
            else:
                self._inflight.pop(owner, None)
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
        """Where a job's output file goes (its directory made); the path stays inside it, and
        is none of the coordinator's own names (its temporary files)."""
        rel = safe_relpath(relpath)
        if any(part.startswith(TMP_PREFIX) for part in rel.split("/")):
            raise UploadError(f"bad output path {relpath[:64]!r}: names starting "
                              f"{TMP_PREFIX!r} are the coordinator's own")
        path = os.path.join(self.output_dir(job_id), rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UploadError(f"bad output path {relpath[:64]!r}: a file of this job's "
                              "outputs stands where it needs a directory") from None
        if os.path.isdir(path):
            raise UploadError(f"bad output path {relpath[:64]!r}: a directory of this job's "
                              "outputs has that name")
        return path

    async def put_output(self, job_id: str, relpath: str, chunks: AsyncIterator[bytes],
                         limit: int = MAX_OUTPUT_FILE_BYTES, owner: str = "",
                         still_allowed: Callable[[], object] | None = None) -> int:
        """Stores one output file of ``owner``'s job from its streamed chunks; returns its
        size. Refused as it streams past ``limit``, the job's outputs cap, the owner's quota
        (other uploads of the job or the owner still streaming count in full) or the disk's
        reserve. Written under a temporary name of its own and renamed when whole, so a broken
        upload leaves no partial file; a file uploaded again replaces the first.
        ``still_allowed`` is called again just before the rename, and refuses by raising: the
        upload may have begun while the job ran, and a finished job's outputs never change."""
        path = self.output_path(job_id, relpath)
        rel = os.path.relpath(path, self.output_dir(job_id))
        before = self._outputs.get(job_id, {}).get(rel, 0)
        what = f"output {relpath[:64]!r} of job {job_id}"
        size = counted = 0  # counted: this upload's bytes in the in-flight tables
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                async for data in chunks:
                    size += len(data)
                    if size > limit:
                        raise UploadError(f"output file {relpath!r} is over {limit:,} bytes")
                    # what is stored (less the file this one replaces), what streams in
                    # (this upload's bytes so far among them) and this chunk
                    streaming = self._inflight_out.get(job_id, 0) + len(data) - before
                    if sum(self._outputs.get(job_id, {}).values()) + streaming \
                            > self.max_job_outputs:
                        raise QuotaExceeded(
                            f"{what} would take the job's outputs past "
                            f"{format_size(self.max_job_outputs)} (--max-job-outputs)")
                    self._check_quota(owner, self._inflight.get(owner, 0) + len(data) - before,
                                      what)
                    self._check_disk(len(data), what)
                    self._inflight_out[job_id] = self._inflight_out.get(job_id, 0) + len(data)
                    self._inflight[owner] = self._inflight.get(owner, 0) + len(data)
                    counted += len(data)
                    await asyncio.to_thread(f.write, data)
            if still_allowed is not None:
                still_allowed()
            try:
                os.replace(tmp, path)
            except OSError as e:
                if is_full(e):
                    raise
                raise UploadError(f"{what} cannot be stored: {e.strerror or e}") from None
        finally:
            self._settle(job_id, owner, counted)
            _unlink(tmp)
        self._count_output(job_id, owner, rel, size)
        return size

    def _settle(self, job_id: str, owner: str, size: int) -> None:
        """An output upload ended: its bytes are in flight no more."""
        for key, table in ((job_id, self._inflight_out), (owner, self._inflight)):
            left = table.get(key, 0) - size
            if left > 0:
                table[key] = left
            else:
                table.pop(key, None)

    def _count_output(self, job_id: str, owner: str, rel: str, size: int) -> None:
        files = self._outputs.setdefault(job_id, {})
        self._output_owner[job_id] = owner
        self._charge(owner, size - files.get(rel, 0))
        files[rel] = size

    def write_output(self, job_id: str, relpath: str, data: bytes, owner: str = "") -> None:
        """A small output the coordinator writes itself (``metrics.json``): not refused by
        quota or reserve, counted all the same."""
        path = self.output_path(job_id, relpath)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            _unlink(tmp)
        self._count_output(job_id, owner, os.path.relpath(path, self.output_dir(job_id)),
                           len(data))

    def outputs(self, job_id: str) -> list[str]:
        """The job's output files, relative paths, sorted."""
        return self._files(self.output_dir(job_id))

    @staticmethod
    def _files(root: str) -> list[str]:
        out = []
        for base, _dirs, files in os.walk(root):
            for name in files:
                if not name.startswith(TMP_PREFIX):  # still arriving
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
        files = self._outputs.pop(job_id, {})
        owner = self._output_owner.pop(job_id, "")
        self._charge(owner, -sum(files.values()))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot delete %s: %s", path, e.strerror)
