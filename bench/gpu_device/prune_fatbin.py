"""Zero the GPU code of every architecture but one in a shared library's CUDA fat binary.

The faiss-cuda wheel carries kernels for sm_80, 86, 89, 90 and 100 (99 MB, 78 MB as xz): more than
one device call can carry (64 MiB). An H100 and an H200 are both sm_90, and the CUDA driver loads
only the entry that matches the device, so the other entries' payloads are overwritten with zeros:
the file keeps its size and layout (headers intact) and compresses to about a third.

    python3 bench/gpu_device/prune_fatbin.py libfaiss-....so 90
"""

from __future__ import annotations

import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50


def _section(path: Path, name: str) -> tuple[int, int]:
    """File offset and size of an ELF section (from readelf)."""
    for line in subprocess.run(
        ["readelf", "-SW", str(path)], capture_output=True, text=True
    ).stdout.splitlines():
        parts = line.replace("[ ", "[").split()
        if len(parts) > 5 and parts[1] == name:
            return int(parts[4], 16), int(parts[5], 16)
    raise SystemExit(f"{path}: no section {name}")


def prune(path: Path, keep_arch: int) -> Counter[int]:
    data = bytearray(path.read_bytes())
    start, size = _section(path, ".nv_fatbin")
    pos, end = start, start + size
    zeroed: Counter[int] = Counter()
    while pos < end:
        magic, _version, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # fat binaries are 8-byte aligned, padded between
            pos += 8
            continue
        entry, stop = pos + header, pos + header + body
        while entry < stop:
            _kind, _ever, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            if arch != keep_arch:
                data[entry + entry_header : entry + entry_header + payload] = bytes(payload)
                zeroed[arch] += payload
            entry += entry_header + payload
        pos = stop
    path.write_bytes(data)
    return zeroed


if __name__ == "__main__":
    counts = prune(Path(sys.argv[1]), int(sys.argv[2]))
    print("zeroed (arch: MB):", {arch: round(n / 1e6, 1) for arch, n in sorted(counts.items())})
