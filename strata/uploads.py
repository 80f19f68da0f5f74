"""Files a job brings from the submitting machine: a ``.keras`` model (``model.keras_file``)
and a project directory (``code.dir``). Pure Python: the client reads and packs them, the
coordinator checks what it stored, and neither imports TensorFlow.

Paths in a job file are relative to that file's directory (as docker-compose and kustomize
resolve theirs), else to the current directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from typing import Iterator

from strata.errors import SpecError, UploadError

CHUNK_BYTES = 1 << 20
#: a blob's name: the SHA-256 of its bytes, lower-case hex
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_KERAS_CONFIG_BYTES = 64 << 20        # config.json inside a .keras file


def resolve(path: str, base_dir: str | None) -> str:
    p = os.path.expanduser(path)
    if not os.path.isabs(p) and base_dir:
        p = os.path.join(base_dir, p)
    return os.path.abspath(p)


def sha256_file(path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(CHUNK_BYTES)
            if not data:
                break
            h.update(data)
            size += len(data)
    return h.hexdigest(), size


def file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while True:
            data = f.read(CHUNK_BYTES)
            if not data:
                return
            yield data


def keras_config(path: str, name: str = "the file") -> str:
    """The ``config.json`` text of a ``.keras`` file (a zip archive), checked to be one."""
    try:
        with zipfile.ZipFile(path) as z:
            try:
                info = z.getinfo("config.json")
            except KeyError:
                raise SpecError("model.keras_file", f"{name} has no config.json: is it a .keras "
                                                    "file saved by keras.Model.save?") from None
            if info.file_size > MAX_KERAS_CONFIG_BYTES:
                raise SpecError("model.keras_file", f"{name}'s config.json is "
                                                    f"{info.file_size:,} bytes; the limit is "
                                                    f"{MAX_KERAS_CONFIG_BYTES:,}")
            raw = z.read("config.json")
            if "model.weights.h5" not in z.namelist():
                raise SpecError("model.keras_file", f"{name} has no model.weights.h5")
    except zipfile.BadZipFile:
        raise SpecError("model.keras_file", f"{name} is not a .keras file (not a zip archive); "
                                            "save the model with model.save('x.keras')") from None
    except OSError as e:
        raise SpecError("model.keras_file", f"cannot read {name}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
        json.loads(text)
    except (UnicodeDecodeError, ValueError):
        raise SpecError("model.keras_file", f"{name}'s config.json is not JSON") from None
    except RecursionError:
        raise SpecError("model.keras_file", f"{name}'s config.json is nested too deeply to "
                                            "be a model") from None
    return text




def attach_files(raw: dict, base_dir: str | None) -> list[str]:
    """Replaces the local paths of a raw job spec (``model.keras_file``) by what travels with
    the job (the file's digest, size, name and, for a model, its config), in place. Returns the
    files to upload before submitting. Raises SpecError naming the field."""
    uploads: list[str] = []
    data = raw.get("data")
    if isinstance(data, dict) and base_dir:
        # data paths are read by the tasks, whose working directory is not the user's: a
        # relative one is taken relative to the job file, as every other path in it
        for key in ("path", "test_path"):
            v = data.get(key)
            if isinstance(v, str) and v and not os.path.isabs(os.path.expanduser(v)):
                data[key] = resolve(v, base_dir)
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("keras_file"), str):
        field = "model.keras_file"
        path = resolve(model["keras_file"], base_dir)
        if not os.path.isfile(path):
            raise SpecError(field, f"{model['keras_file']!r}: no such file ({path})")
        config = keras_config(path, os.path.basename(path))
        sha, size = sha256_file(path)
        model["keras_file"] = {"name": os.path.basename(path), "sha256": sha, "size": size,
                               "config": config}
        uploads.append(path)
    code = raw.get("code")
    if isinstance(code, dict) and isinstance(code.get("dir"), str):
        path = resolve(code["dir"], base_dir)
        if not os.path.isdir(path):
            raise SpecError("code.dir", f"{code['dir']!r}: no such directory ({path})")
        archive = pack_dir(path)
        sha, size = sha256_file(archive)
        rest = {k: v for k, v in code.items() if k != "dir"}
        raw["code"] = {"dir_name": os.path.basename(path.rstrip("/")) or "code", "sha256": sha,
                       "size": size, **rest}
        uploads.append(archive)
    return uploads


#: what packing a code directory leaves out: version control, caches, virtual environments
PACK_EXCLUDE_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".mypy_cache",
                     ".pytest_cache", ".ruff_cache", "node_modules", ".strata"}
MAX_CODE_BYTES = 256 << 20


def pack_dir(path: str) -> str:
    """``path`` packed as a .tar.gz in a temporary file (files in sorted order, times and owners
    zeroed, so the same tree packs to the same bytes and uploads once). Refuses a tree over
    ``MAX_CODE_BYTES`` before compression, naming the largest files."""
    import gzip
    import tarfile
    import tempfile

    files: list[tuple[str, str, int]] = []
    for base, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in PACK_EXCLUDE_DIRS)
        for n in sorted(names):
            full = os.path.join(base, n)
            if n.endswith((".pyc", ".pyo")) or os.path.islink(full) or not os.path.isfile(full):
                continue
            files.append((full, os.path.relpath(full, path), os.path.getsize(full)))
    total = sum(f[2] for f in files)
    if total > MAX_CODE_BYTES:
        big = sorted(files, key=lambda f: -f[2])[:3]
        raise SpecError("code.dir", f"{path} holds {total:,} bytes; the limit is "
                                    f"{MAX_CODE_BYTES:,} (largest: "
                                    + ", ".join(f"{r} {n:,}" for _, r, n in big)
                                    + "); keep data out of it and read it by path")
    fd, out = tempfile.mkstemp(prefix="strata-code-", suffix=".tar.gz")
    with os.fdopen(fd, "wb") as raw_f, gzip.GzipFile(fileobj=raw_f, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for full, rel, _ in files:
            info = tar.gettarinfo(full, arcname=rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o644
            with open(full, "rb") as f:
                tar.addfile(info, f)
    return out


def safe_relpath(path: str) -> str:
    """``path`` as a relative path inside a directory, or UploadError (a path from the wire
    never escapes the directory it is written into)."""
    p = os.path.normpath(str(path).replace("\\", "/"))
    if not path or os.path.isabs(p) or p == "." or p.startswith("..") or "\0" in p:
        raise UploadError(f"bad output path {str(path)[:200]!r}: must be relative, inside the "
                          "job's output directory")
    parts = p.split("/")
    if len(p) > MAX_OUTPUT_PATH_CHARS or any(len(x.encode()) > 255 for x in parts) \
            or len(parts) > 32:
        raise UploadError(f"bad output path {str(path)[:64]!r}: at most "
                          f"{MAX_OUTPUT_PATH_CHARS} characters, 32 levels, 255 bytes a name")
    return p


#: an output path's length: what a job's outputs need (model.keras, tensorboard/ROLE-INDEX/...)
MAX_OUTPUT_PATH_CHARS = 1024
