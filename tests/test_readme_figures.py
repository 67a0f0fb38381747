"""Every figure the README quotes comes from a committed results file, so it cannot go stale.

The rule the README is written to: a decimal number in its prose (outside code blocks and
`code spans`) is a measured figure, and the bullet, paragraph or table row that quotes it links the
results file it comes from (under docs/results/, bench/results/ or the committed analyses). The
test reads that file and looks the figure up: in a Markdown or text file as the same number
(thousands separators aside), in a JSON file as a number that rounds to it. A setting or a version
that is not a measurement goes in a code span. Changing a figure in the README without its results
file, or quoting one without naming its file, fails here.

The second test checks that every relative link of the README and of the pages under docs/
points to a file or folder inside the repository.
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Where measurements are committed: a figure is only looked up in a linked file under these.
RESULTS = (
    "docs/results/",
    "bench/results/",
    "docs/loss-comparison/",
    "docs/paper-regime/",
    "docs/paper-findings.",
)

DECIMAL = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})*\.\d+(?!\.?\d)|(?<![\w.,])\d+\.\d+(?!\.?\d)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
URL = re.compile(r"https?://\S+")


def _units(text: str) -> list[str]:
    """The README's prose outside fenced code, cut into bullets, table rows and paragraphs."""
    units: list[list[str]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            units.append([])
            continue
        if fenced or not line.strip():
            units.append([])
            continue
        starts_unit = re.match(r"\s{0,1}([-*|]|\d+\.)\s", line) is not None or line.startswith("|")
        if starts_unit or not units or not units[-1]:
            units.append([line])
        else:
            units[-1].append(line)
    return [" ".join(lines) for lines in units if lines]


def _figures(unit: str) -> list[str]:
    prose = URL.sub(" ", LINK.sub("]", CODE_SPAN.sub(" ", unit)))
    return [m.group(0).replace(",", "") for m in DECIMAL.finditer(prose)]


def _results_files(unit: str) -> list[Path]:
    files = []
    for target in LINK.findall(CODE_SPAN.sub(" ", unit)):
        path = target.split("#", 1)[0]
        if path.startswith(RESULTS) and (ROOT / path).is_file():
            files.append(ROOT / path)
    return files


def _json_numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _json_numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _json_numbers(v)]
    return []


def _holds(path: Path, figure: str) -> bool:
    """Whether the results file states ``figure`` (a decimal as the README writes it)."""
    text = path.read_text()
    if figure in {token.replace(",", "") for token in NUMBER.findall(text)}:
        return True
    if path.suffix == ".json":
        step = Decimal(1).scaleb(-len(figure.split(".")[1]))
        return any(
            Decimal(repr(n)).quantize(step, rounding=ROUND_HALF_UP) == Decimal(figure)
            for n in _json_numbers(json.loads(text))
        )
    return False


def _quoted() -> list[tuple[str, str, list[Path]]]:
    """(unit, figure, the results files the unit links) for every figure in the README."""
    return [
        (unit, figure, _results_files(unit))
        for unit in _units(README.read_text())
        for figure in _figures(unit)
    ]


def test_the_rule_sees_figures_code_and_links() -> None:
    unit = "- P@10 1,234.5, 2.5x and `0.5` at `temperature=0.1` ([r](bench/results/vm-2026-11-24.md), https://x.io/1.5)"
    assert _figures(unit) == ["1234.5", "2.5"]
    assert _results_files(unit) == [ROOT / "bench/results/vm-2026-11-24.md"]
    assert _units("a 1.5\nb\n\n- c 2.5\n  d\n| e | 3.5 |\n```\n4.5\n```\n") == [
        "a 1.5 b",
        "- c 2.5   d",
        "| e | 3.5 |",
    ]
    assert _holds(ROOT / "bench/results/synth-vm-2026-11-24.json", "1.44")  # 1.4439... rounds to it
    assert not _holds(ROOT / "bench/results/synth-vm-2026-11-24.json", "1.45")
    assert not _holds(ROOT / "bench/results/vm-2026-11-24.md", "304.18")  # the file says 304.182


def test_every_figure_in_the_readme_is_in_the_results_file_it_links() -> None:
    quoted = _quoted()
    assert len(quoted) >= 5, "the README quotes its key figures; did the rule stop seeing them?"
    unlinked = [f"{figure}: {unit[:100]}" for unit, figure, files in quoted if not files]
    assert not unlinked, "figures whose line links no results file:\n" + "\n".join(unlinked)
    stale = [
        f"{figure} not in {', '.join(str(f.relative_to(ROOT)) for f in files)}: {unit[:100]}"
        for unit, figure, files in quoted
        if not any(_holds(path, figure) for path in files)
    ]
    assert not stale, "figures the linked results files do not hold:\n" + "\n".join(stale)


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_inside_the_repository(page: Path) -> None:
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links outside the repository or to nothing: {broken}"


def test_the_readme_names_no_path_outside_the_repository() -> None:
    assert "../" not in README.read_text()
