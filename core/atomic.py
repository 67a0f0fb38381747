"""Atomic file and folder writes: a reader sees the old one or the complete new one, never a partial
write.

The data go to a temporary file in the target's folder (same filesystem, so the rename is atomic),
are flushed and fsynced, and the temporary file is then renamed over the target. On any exception,
KeyboardInterrupt included, the temporary file is removed and the target is left untouched. Like
``tempfile.mkstemp``, the new file is readable and writable by its owner only (mode 0600).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` atomically through ``write(handle)`` (a binary file object); returns the path.

    Creates the parent folder if needed. ``write`` may call e.g. ``np.save(handle, ...)`` or
    ``torch.save(obj, handle)``; its return value is ignored.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (no newline translation); returns the path."""
    data = text.encode(encoding)
    return atomic_write(path, lambda handle: handle.write(data))


def replace_dir(new: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Rename the complete folder ``new`` to ``target``; an old ``target`` is moved aside, then deleted.

    Linux cannot atomically exchange two directories with one rename, so for a moment there is no
    folder at ``target``, but never a partial one; if the final rename fails, the old one is put back.
    """
    new, target = Path(new), Path(target)
    if not target.exists():
        os.rename(new, target)
        return target
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return target


@contextmanager
def staged_dir(target: str | os.PathLike[str], marker: str = ".partial-") -> Iterator[Path]:
    """A new empty folder beside ``target`` to write a whole artifact folder into: when the block
    ends normally it replaces ``target`` (:func:`replace_dir`); on any exception, KeyboardInterrupt
    included, it is removed and ``target`` is left as it was. Its name is ``.<target><marker><pid>-<hex>``,
    so a clean-up can tell whose process left one behind."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}{marker}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to the disk (before the folder holding it is renamed into place)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
