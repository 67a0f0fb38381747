"""The peak RSS that builds and benchmarks report is their own, not their parent's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from icr.core.memory import peak_rss_mb

CHILD = (
    "import json, resource; from icr.core.memory import peak_rss_mb; "
    "print(json.dumps([peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_reports_its_own_peak_not_its_parents():
    ballast = np.ones(400 << 18, np.float32)  # 400 MiB, every page touched
    assert peak_rss_mb() >= 400
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    own, inherited = json.loads(done.stdout)
    # an interpreter and numpy: well under the parent's 400 MiB of ballast. ru_maxrss, which Linux
    # carries over exec, said 491 MiB here (measured 2026-11-23), the parent's peak
    assert own < 300, f"child VmHWM {own:.0f} MiB (ru_maxrss {inherited:.0f} MiB)"
    del ballast


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_resident_memory_splits_into_anonymous_and_file_pages(tmp_path):
    from icr.core.memory import resident_mb

    before = resident_mb()
    ballast = np.ones(200 << 18, np.float32)  # 200 MiB of anonymous pages, every one touched
    path = tmp_path / "mapped.f32"
    np.ones(100 << 18, np.float32).tofile(path)
    mapped = np.memmap(path, np.float32, mode="r")
    assert float(mapped.sum()) == 100 << 18  # every page of the 100 MiB file read through the map
    now = resident_mb()
    assert set(now) == {"rss_mb", "anon_mb", "file_mb"}
    assert now["anon_mb"] - before["anon_mb"] >= 190 and now["file_mb"] - before["file_mb"] >= 95
    assert abs(now["rss_mb"] - now["anon_mb"] - now["file_mb"]) < 64  # the rest is shared memory
    del ballast, mapped
