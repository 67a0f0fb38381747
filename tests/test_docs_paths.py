"""The manual names files that exist: every repository path the README and the docs quote in
backticks (``training/train.py``, ``service/``) is there, so a moved or renamed module cannot leave
the documentation pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = (
    "core",
    "training",
    "index",
    "service",
    "icr",
    "bench",
    "tests",
    "api_tests",
    "docs",
    "examples",
    ".ci",
)
# `training/models/`, `index/build.py`: a top folder, then path characters; no spaces,
# no globs or placeholders (`<name>`, `*`, `{split}`)
QUOTED = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)`")


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_quoted_repository_path_exists() -> None:
    missing = []
    for doc in _documents():
        for match in QUOTED.finditer(doc.read_text()):
            path = match.group(1).rstrip(".")
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "quoted paths that do not exist:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_path() -> None:
    assert QUOTED.findall("see `training/nope.py` and `index/build.py`") == [
        "training/nope.py",
        "index/build.py",
    ]
