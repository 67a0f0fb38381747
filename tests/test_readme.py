"""The README's two set-up commands are what CI runs and what a user types first."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None, "README must open with a bash block"
    assert text.index("```bash") < text.index("\n## "), "the set-up commands come before any section"
    return [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    run, test = commands
    assert run.endswith("icr demo") and "pip install" in run
    assert "pytest" in test and "pip install" in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci, ".ci/run must run the README's test command verbatim"


def test_ci_script_is_executable_and_strict() -> None:
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & 0o111
    assert "set -euo pipefail" in ci.read_text()
