"""A snapshot of a living index: one folder that ``icr serve --index`` starts from, holding the
build's files, the write log up to one sequence number, and the uploaded images it names.

The build's files never change once written (each is replaced by a rename, never rewritten), so
they are hard-linked where the file system allows and copied where it does not: a snapshot of a
1M-image index costs the log's size, not the index's. Files referenced by path (the gallery images
an index was built from) stay where they are, as in any index folder.

A folder holding its own ``writes.sqlite`` is served with that log (:func:`snapshot_log`): a server
started from a snapshot sees its writes with no state directory, and takes new writes into it when
writes are on (serve a copy, ``cp -a``, to keep the snapshot as it was).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from icr.core.atomic import fsync_file, staged_dir
from icr.index.live_index import LiveIndex
from icr.index.live_writes import UPLOAD_PREFIX, UPLOADS_FOLDER, WRITES_FILE

SNAPSHOT_FILE = "snapshot.json"
SNAPSHOTS_FOLDER = "snapshots"  # where the server writes them, in its state directory
_SKIPPED = (WRITES_FILE, SNAPSHOT_FILE, UPLOADS_FOLDER)  # a snapshot's own, written anew
_SQLITE_SIDE = ("-wal", "-shm", "-journal")


def snapshot_log(directory: Path) -> Path | None:
    """The write log a snapshot folder carries (None: a build's folder, whose log is the server's)."""
    log = directory / WRITES_FILE
    return log if (directory / SNAPSHOT_FILE).is_file() and log.is_file() else None


def link_or_copy(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> str:
    """Hard-link ``source`` at ``target`` (a file never rewritten in place), or copy it where links
    cannot be made; returns which ("linked" or "copied")."""
    try:
        os.link(source, target)
        return "linked"
    except OSError:  # another file system, or links not allowed
        shutil.copy2(source, target)
        fsync_file(target)
        return "copied"


def link_folder(directory: Path, target: Path, skipped: tuple[str, ...]) -> dict[str, int]:
    """Link (or copy) the files and folders of ``directory`` into ``target``, but not ``skipped``
    names, hidden ones or SQLite's side files; returns {"linked": n, "copied": n}."""
    how = {"linked": 0, "copied": 0}

    def link(source: str | os.PathLike[str], to: str | os.PathLike[str]) -> None:
        how[link_or_copy(source, to)] += 1

    for path in sorted(directory.iterdir()):
        if path.name in skipped or path.name.startswith(".") or path.name.endswith(_SQLITE_SIDE):
            continue
        if path.is_dir():
            shutil.copytree(path, target / path.name, copy_function=link)
        else:
            link(path, target / path.name)
    return how


def write_snapshot(live: LiveIndex, directory: Path, out: Path) -> dict[str, Any]:
    """Write the snapshot of ``live`` (served from the index folder ``directory``) to the new folder
    ``out``, complete or not at all. Returns what it holds. FileExistsError when ``out`` exists."""
    t0 = time.perf_counter()
    if out.exists():
        raise FileExistsError(f"{out.name}: a snapshot of that name exists; choose another name")
    state = live.refresh()  # every write committed so far
    with staged_dir(out) as tmp:
        how = link_folder(directory, tmp, _SKIPPED)
        writes = 0 if live.log is None or state.seq == 0 else live.log.export(tmp / WRITES_FILE, state.seq)
        files = _uploads(tmp / WRITES_FILE, live.uploads, tmp / UPLOADS_FOLDER) if writes else 0
        info = {
            "format_version": 1,
            "index_key": live.key,
            "seq": state.seq,
            "images": state.size,
            "writes": writes,
            "uploads": files,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "from": directory.name,
        }
        (tmp / SNAPSHOT_FILE).write_text(json.dumps(info, indent=2) + "\n")
        fsync_file(tmp / SNAPSHOT_FILE)
    return {
        **info,
        "files_linked": how["linked"],
        "files_copied": how["copied"],
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _uploads(log: Path, uploads: Path | None, target: Path) -> int:
    """Link the uploaded images the log names into ``target``; returns how many."""
    with closing(sqlite3.connect(log)) as db:
        names = [
            r[0][len(UPLOAD_PREFIX) :]
            for r in db.execute(
                "SELECT DISTINCT source FROM writes WHERE source LIKE ?", (UPLOAD_PREFIX + "%",)
            )
        ]
    if not names:
        return 0
    if uploads is None:
        raise FileNotFoundError("the log names uploaded images, but this index keeps no uploads folder")
    target.mkdir()
    for name in names:
        link_or_copy(uploads / name, target / name)
    return len(names)
