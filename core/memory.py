"""This process's peak resident memory, for the figures builds and benchmarks report."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mb() -> float:
    """Peak RSS of this program in MiB: ``VmHWM`` of /proc/self/status where Linux has it.

    Not ``ru_maxrss``: Linux carries that over exec from the parent (a child started by vfork/fork +
    exec reports at least its parent's peak), so a build or benchmark started by a large process
    (``icr bench`` after its ANN peers) reported the parent's size. ``VmHWM`` belongs to the
    program's own address space, which exec creates afresh.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
