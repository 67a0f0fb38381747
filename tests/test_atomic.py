"""training.atomic: complete file or the old one, no temporary files left behind."""

from __future__ import annotations

import pytest

from icr.core.atomic import atomic_write, atomic_write_text


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
