"""`.ci/check` runs what CI runs (`.ci/run`), on the venv a developer already has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands(script: Path) -> set[str]:
    """The commands a script runs: each line and each part of an && chain, comments and shell
    plumbing (set, cd, if, variables, exit-status lines) left out, the test selection dropped."""
    out = set()
    for line in script.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "set ", "cd ", "if ", "fi", "tests=", "status=", "apt-get")):
            continue
        for part in line.split("&&"):
            command = re.sub(r'\s*"\$\{tests\[@\]\}"', "", part.strip())
            if command:
                out.add(command)
    return out


def test_the_check_command_runs_what_ci_runs() -> None:
    check, run = _commands(ROOT / ".ci" / "check"), _commands(ROOT / ".ci" / "run")
    assert check <= run, check - run
    only_ci = {c for c in run - check if not c.startswith(("python3 -m venv", ".venv/bin/pip install"))}
    # besides building the venv, CI only adds the bench smoke run
    assert len(only_ci) == 1 and next(iter(only_ci)).startswith(".venv/bin/icr bench --quick"), only_ci
    assert {".venv/bin/ruff check .", ".venv/bin/ruff format --check .", ".ci/mypy"} <= check


def test_the_check_command_is_executable_and_strict() -> None:
    check = ROOT / ".ci" / "check"
    assert check.stat().st_mode & 0o111
    assert "set -euo pipefail" in check.read_text()
    assert ".ci/check" in (ROOT / "CONTRIBUTING.md").read_text()
