"""This process's resident memory, peak and now, for the figures builds and benchmarks report."""

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
    hwm = _status_mb(("VmHWM",)).get("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def resident_mb() -> dict[str, float]:
    """This process's resident memory now, MiB: all of it (``rss_mb``), its anonymous pages
    (``anon_mb``) and its file-backed ones (``file_mb``: mapped files such as an on-disk index);
    empty where /proc/self/status is missing."""
    now = _status_mb(("VmRSS", "RssAnon", "RssFile"))
    names = {"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb"}
    return {names[field]: value for field, value in now.items()}


def _status_mb(fields: tuple[str, ...]) -> dict[str, float]:
    """The ``fields`` of /proc/self/status (kB) that Linux has, in MiB."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name = line.split(":")[0]
            if name in fields:
                out[name] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out
