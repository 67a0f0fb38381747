"""The artifact watcher's decisions, with real files and stand-in loaders: unchanged, swapped in,
refused while a file changed in place does not load, kept when replaced files do not load, and a
failed load retried only when the files change again."""

from __future__ import annotations

import os
from pathlib import Path

from icr.service.watcher import ArtifactWatcher, changed_in_place, snapshot


def test_in_place_is_same_inode_other_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"one")
    b.write_bytes(b"two")
    before = snapshot([a, b, tmp_path / "absent"])
    assert before[tmp_path / "absent"] is None
    with open(a, "r+b") as handle:
        handle.write(b"ONE, longer")
    (tmp_path / "b2").write_bytes(b"TWO")
    os.replace(tmp_path / "b2", b)  # replaced: another inode
    after = snapshot([a, b, tmp_path / "absent"])
    assert changed_in_place(before, after) == [a]


def test_watcher_decisions(tmp_path: Path) -> None:
    served = tmp_path / "index.faiss"
    served.write_bytes(b"v1")
    state: dict = {"loads": 0, "fail": False, "retriever": "r1", "refused": None}

    def reload() -> str:
        state["loads"] += 1
        if state["fail"]:
            raise ValueError("index.faiss: its content changed since the build")
        return f"r{state['loads'] + 1}"

    watcher = ArtifactWatcher(
        lambda: [served],
        60.0,
        reload=reload,
        swap=lambda r: state.__setitem__("retriever", r),
        refuse=lambda reason: state.__setitem__("refused", reason),
        describe=str,
    )
    assert watcher.check() == "unchanged" and state["loads"] == 0

    replacement = tmp_path / "new"
    replacement.write_bytes(b"v2")
    os.replace(replacement, served)
    assert watcher.check() == "reloaded" and state["retriever"] == "r2" and state["refused"] is None

    state["fail"] = True
    with open(served, "r+b") as handle:  # rewritten in place, and it no longer loads
        handle.write(b"xx!")
    assert watcher.check() == "refused" and "index.faiss changed on disk" in state["refused"]
    assert watcher.check() == "unchanged" and state["loads"] == 2  # not retried until it changes again

    state["fail"] = False
    with open(served, "r+b") as handle:
        handle.write(b"v3 whole")
    assert watcher.check() == "reloaded" and state["refused"] is None

    state["fail"] = True
    replacement.write_bytes(b"broken")
    os.replace(replacement, served)  # replaced: the open handles still read the served files
    assert watcher.check() == "kept" and state["refused"] is None and state["retriever"] == "r4"
