"""`icr serve` refuses artifacts that do not belong together, with one message saying what rebuilds what."""

from __future__ import annotations

import shutil
import subprocess

from conftest import ICR, ROOT


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ICR), "serve", *args, "--port", "9"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_a_checkpoint_from_other_weights_is_refused_with_the_rebuild_command(artifacts, tmp_path) -> None:
    other = tmp_path / "other"
    shutil.copytree(artifacts.checkpoint, other)
    config = (other / "config.json").read_text()
    sha = config.split('"weights_sha256": "')[1][:64]
    (other / "config.json").write_text(config.replace(sha, "0" * 64))
    r = _serve("--index", str(artifacts.images), "--checkpoint", str(other))
    assert r.returncode != 0
    assert "cannot serve these artifacts together" in r.stderr and "icr index build" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_or_wrong_kind_of_index_is_refused(artifacts, tmp_path) -> None:
    r = _serve("--index", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "manifest" in r.stderr and "Traceback" not in r.stderr
    r = _serve("--index", str(artifacts.captions))
    assert r.returncode != 0 and "--caption-index" in r.stderr
    r = _serve()
    assert r.returncode != 0 and "index" in r.stderr and "ICR_" in r.stderr
