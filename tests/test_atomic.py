"""training.atomic: complete file or the old one, no temporary files left behind."""

from __future__ import annotations

import os

import pytest

from icr.core.atomic import atomic_write, atomic_write_text, staged_dir


def test_writes_creates_the_folder_and_replaces(tmp_path):
    path = tmp_path / "a" / "b" / "f.bin"
    assert atomic_write(path, lambda handle: handle.write(b"one")) == path
    assert path.read_bytes() == b"one"
    atomic_write_text(str(path), "twö\n")
    assert path.read_bytes() == "twö\n".encode()
    assert [p.name for p in path.parent.iterdir()] == ["f.bin"]


def test_a_failing_write_keeps_the_old_file_and_cleans_up(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")

    def fail(handle):
        handle.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_staged_folder_replaces_the_target_only_when_complete(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(target) as tmp:
            (tmp / "new.txt").write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in target.iterdir()] == ["old.txt"]  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staged folder is gone
    with staged_dir(target, ".building-") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".out.building-{os.getpid()}-")
        (tmp / "new.txt").write_text("whole")
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
