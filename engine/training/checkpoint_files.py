"""Checkpoint shard files: atomic writes that report SHA-256 and size, the check of both before a read, and
shard paths confined to the checkpoint directory."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any, Callable

from ..errors import CheckpointError

CHUNK = 8 << 20
FIX = "restore the file from a copy, or load an earlier checkpoint"
MANIFEST_FIX = "restore manifest.json from a copy, or load an earlier checkpoint"


def atomic_write(target: Path, write: Callable[[IO[bytes]], Any]) -> dict[str, Any]:
    """Temp file in the same directory, fsync, os.replace: readers see the old file or the new one.

    Returns the `{"sha256", "bytes"}` of the bytes on disk, hashed from the temp file before the rename."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        sha256, size = digest(Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)
    return {"sha256": sha256, "bytes": size}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(file: Path) -> tuple[str, int]:
    """(SHA-256 hex digest, size in bytes) of a file's contents."""
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def confine(root: Path, entry: Any, where: str) -> Path:
    """The resolved path of manifest entry `entry` (named `where` in errors), refused unless it is a relative
    path without `..` that resolves inside `root` (symlinks followed)."""
    if not isinstance(entry, str) or not entry:
        raise CheckpointError(f"{root}/manifest.json: {where} is {entry!r}, not a file name; {MANIFEST_FIX}")
    try:
        why, fix, resolved = None, MANIFEST_FIX, (root / entry).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise CheckpointError(f"{root}/manifest.json names {entry!r} ({where}), which cannot be resolved ({exc}); "
                              f"{FIX}") from exc
    if PurePosixPath(entry).is_absolute() or PureWindowsPath(entry).is_absolute() or entry.startswith("\\"):
        why = "is an absolute path"
    elif ".." in PurePosixPath(entry.replace("\\", "/")).parts:
        why = "contains '..'"
    elif resolved == root.resolve():
        why = "is the checkpoint directory itself"
    elif not resolved.is_relative_to(root.resolve()):
        why = f"resolves to {resolved}, outside {root.resolve()}"
        if any(p.is_symlink() for p in [root / entry, *(root / entry).parents][:len(Path(entry).parts)]):
            why += " through a symbolic link"
            fix = "copy the file itself in place of the link, or load an earlier checkpoint"
    if why is not None:
        raise CheckpointError(f"{root}/manifest.json names {entry!r} ({where}), which {why}: refused, a checkpoint "
                              f"reads only files inside its own directory; {fix}")
    return resolved


def verify(file: Path, record: dict, files: list[dict]) -> None:
    """Raise CheckpointError unless `file` has the size and SHA-256 its manifest `record` gives.

    `files` (every shard's record) names the shard whose bytes these are, when they are another's."""
    if record.get("sha256") is None:  # a format-1 manifest: nothing to check against (read_manifest warned)
        return
    try:
        size = file.stat().st_size
        same_size = size == record["bytes"] or any(f.get("bytes") == size for f in files)
        sha256 = digest(file)[0] if same_size else None  # another size: hashed only if it could be another shard
    except OSError as exc:
        raise CheckpointError(f"checkpoint shard {file} cannot be read ({exc.strerror or exc}); {FIX}") from exc
    same = [f["path"] for f in files if sha256 is not None and f.get("sha256") == sha256 and f is not record]
    whose = f"; these are the bytes of {same[0]} (files swapped or copied over?)" if same else ""
    if size != record["bytes"]:
        grown = "truncated" if size < record["bytes"] else "grown"
        raise CheckpointError(f"checkpoint shard {file} is damaged: expected {record['bytes']} bytes, found {size} "
                              f"({grown} or replaced){whose}; {FIX}")
    if sha256 != record["sha256"]:
        raise CheckpointError(f"checkpoint shard {file} is damaged: expected sha256 {record['sha256']}, found "
                              f"{sha256} ({size} bytes, as expected){whose}; {FIX}")
