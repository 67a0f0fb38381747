"""Served artifacts changed on disk: swapped in when whole, refused while broken.

Every ``ICR_WATCH_SECONDS`` (0: off) the watcher stats the files being served: each index folder's
``manifest.json``, ``index.faiss``, ``metadata.sqlite``, ``calibration.json``, ``index.ivfdata``, and
the checkpoint's ``config.json`` and weights. When any of them changed (inode, size or mtime), it
loads the artifacts at the configured paths beside the served ones, exactly as ``POST
/v1/admin/reload`` does, and:

- they load (a folder rebuilt by ``icr index build``, which renames it into place): they are swapped
  in, and no request fails;
- they do not, and a served file was changed *in place* (same inode, other content: the process
  may be reading the new bytes through its open handles): searches and ``/readyz`` answer 503 with
  the reason until the files are whole again (then the next check swaps them in);
- they do not, but the served files were only *replaced* (the open handles still read the old,
  consistent ones): the server keeps serving them and logs why the new ones were refused.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("icr.service")

WATCHED_IN_INDEX = ("manifest.json", "index.faiss", "metadata.sqlite", "calibration.json", "index.ivfdata")
WATCHED_IN_CHECKPOINT = ("config.json", "model.safetensors")
Stat = tuple[int, int, int] | None  # (inode, size, mtime_ns), None when the file is absent


def watched_files(folders: list[Path], checkpoint: Path | None) -> list[Path]:
    files = [folder / name for folder in folders for name in WATCHED_IN_INDEX]
    if checkpoint is not None:
        files += [checkpoint / name for name in WATCHED_IN_CHECKPOINT]
    return files


def snapshot(files: list[Path]) -> dict[Path, Stat]:
    out: dict[Path, Stat] = {}
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            out[path] = None
            continue
        out[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def changed_in_place(before: dict[Path, Stat], after: dict[Path, Stat]) -> list[Path]:
    """Files with the same inode and other size or mtime: rewritten under the served handles."""
    return [
        path
        for path, old in before.items()
        if old is not None and (new := after.get(path)) is not None and new[0] == old[0] and new != old
    ]


class ArtifactWatcher:
    """Polls ``files`` every ``interval`` seconds; ``reload()`` returns the new retriever or raises;
    ``swap(retriever)`` installs it; ``refuse(reason | None)`` sets or clears the 503 state. A failed
    load is not retried until the files change again."""

    def __init__(
        self,
        files: Callable[[], list[Path]],
        interval: float,
        reload: Callable[[], Any],
        swap: Callable[[Any], None],
        refuse: Callable[[str | None], None],
        describe: Callable[[Exception], str],
    ) -> None:
        self.files, self.interval = files, interval
        self.reload, self.swap, self.refuse, self.describe = reload, swap, refuse, describe
        self.baseline = snapshot(files())
        self.failed: dict[Path, Stat] | None = None  # the files as they were when a reload failed
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="icr-watch", daemon=True)
        self.lock = threading.Lock()  # one check at a time (a test may call check() directly)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # never let the watcher die: it is the only thing that clears a refusal
                log.exception("artifact watcher check failed")

    def check(self) -> str:
        """One poll: ``unchanged``, ``reloaded``, ``refused`` or ``kept``."""
        with self.lock:
            now = snapshot(self.files())
            if now == self.baseline or now == self.failed:  # a failed load is retried when they change again
                return "unchanged"
            in_place = changed_in_place(self.baseline, now)
            try:
                fresh = self.reload()
            except Exception as err:  # whatever the changed files do, the verdict is the same
                self.failed = now
                reason = self.describe(err)
                if in_place:
                    names = ", ".join(p.name for p in in_place)
                    self.refuse(
                        f"{names} changed on disk while being served and the artifacts no longer load "
                        f"({reason}); restore them or rebuild the index folder (icr index build renames a "
                        "complete one into place) and the server switches to it within seconds"
                    )
                    return "refused"
                log.warning(
                    "artifacts changed on disk but do not load (%s); still serving the previous ones", reason
                )
                return "kept"
            self.swap(fresh)
            self.rebase()
            log.info("artifacts changed on disk: reloaded")
            return "reloaded"

    def rebase(self) -> None:
        """The served artifacts are what is on disk now (after a load or an admin reload)."""
        self.baseline, self.failed = snapshot(self.files()), None
        self.refuse(None)
