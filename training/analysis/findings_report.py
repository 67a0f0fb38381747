"""The papers' findings report: each finding's verdict on our loss comparisons, written as
``docs/paper-findings.md`` and its JSON.

The findings are :data:`~icr.training.analysis.findings_catalogue.FINDINGS`, each judged by
:func:`~icr.training.analysis.findings_verdict.evaluate`; the markdown repeats the verdict rule
(:data:`~icr.training.analysis.findings_verdict.VERDICT_RULE`) and sets the paper's numbers next to ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from icr.core.atomic import atomic_write_text
from icr.training.analysis.findings_catalogue import FINDINGS
from icr.training.analysis.findings_verdict import (
    ABOVE,
    ANTI_RANKED,
    AT_LEAST,
    BELOW,
    BEST_ALSO,
    ENCODERS,
    EQUALS,
    GREATER,
    NOT_RUN,
    NOT_TESTABLE,
    PAIRWISE,
    SIMILAR,
    TESTABLE,
    VERDICT_RULE,
    VERDICTS,
    Finding,
    Outcome,
    as_mean_std,
    evaluate,
)
from icr.training.analysis.paper_numbers import NUMBERS, PAPERS
from icr.training.analysis.regime_differences import differences
from icr.training.analysis.regime_differences import markdown as regime_markdown


def _fmt(x: float | None, like: float | None = None) -> str:
    if x is None:
        return "–"
    ref = abs(like if like is not None else x)
    digits = 1 if ref >= 100 else 2 if ref >= 1 else 4 if ref > 0 else 2
    return f"{x:.{digits}f}"


def _fmt_p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def _paper_group(keys: Sequence[str], finding: Finding) -> str:
    numbers = [NUMBERS[k] for k in keys]
    first = numbers[0]
    label = f"{first.dataset}, {first.method}"
    same_column = len({n.column for n in numbers}) == 1
    parts = [f"{n.row}{'' if same_column else ' ' + n.column} {n.text()}" for n in numbers]
    text = f"{label}{' [' + first.column + ']' if same_column else ''}: " + " vs ".join(parts)
    if finding.kind in PAIRWISE and len(numbers) == 2 and all(n.mean is not None for n in numbers):
        a, b = numbers
        assert a.mean is not None and b.mean is not None
        text += f" (Δ {a.mean - b.mean:+.{1 if abs(a.mean) >= 10 else 2}f})"
    return text


def _paper_cell(finding: Finding) -> str:
    return "<br>".join(_paper_group(group, finding) for group in finding.evidence)


def _ours_cell(outcome: Outcome) -> str:
    shared = len({o["metric"] for o in outcome.ours}) == 1
    cells = []
    for o in outcome.ours:
        if o["mean"] is None:
            value = "not run"
        else:
            std = "" if o["std"] is None else f" ± {_fmt(o['std'], o['mean'])}"
            value = f"{_fmt(o['mean'])}{std} ({o['runs']} seeds)"
            if o.get("batch_std") is not None:
                value += f"; over batches ± {_fmt(o['batch_std'], o['mean'])}"
        cells.append(f"`{o['variant']}`{'' if shared else ' ' + o['metric']}: {value}")
    return "<br>".join(cells)


def _test_cell(outcome: Outcome) -> str:
    test = outcome.test
    if test is None:
        return "–"
    lo, hi = test["interval_90"]
    ref = max(abs(lo), abs(hi), abs(test["estimate"]))
    cell = (
        f"{test['name']}: {_fmt(test['estimate'], ref)} [{_fmt(lo, ref)}, {_fmt(hi, ref)}], "
        f"df {test['df']:.1f}"
    )
    return cell + (f", p {_fmt_p(outcome.p)}" if outcome.p is not None else "")


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _claim_cell(finding: Finding) -> str:
    kind = {
        GREATER: "A > B",
        AT_LEAST: "A ≥ B",
        SIMILAR: "A ≈ B",
        EQUALS: f"= {finding.target:g} ± {finding.tolerance:g}" if finding.target is not None else "=",
        ABOVE: f"> {finding.target:g} (tol. {finding.tolerance:g})" if finding.target is not None else ">",
        BELOW: f"< {finding.target:g} (tol. {finding.tolerance:g})" if finding.target is not None else "<",
        ANTI_RANKED: "more counted ⇒ lower score",
        BEST_ALSO: "best on the first ⇒ not below any on the second",
    }[finding.kind]
    metrics = ", ".join(f"`{m}`" for m in dict.fromkeys(finding.metrics))
    cell = f"**{finding.id}** ({finding.table})<br>{finding.claim}<br>{finding.encoder}: {metrics}; {kind}"
    if finding.note:
        cell += f"<br>*{finding.note}*"
    return cell


def _regime_text(report: Mapping[str, Any]) -> str:
    regime = report.get("regime")
    if isinstance(regime, Mapping):
        # epochs 0 means "the base config's own", which a bare `0` would hide from a reader
        return ", ".join(
            f"{k} `{json.dumps(v)}`" + (" (the base config's own)" if (k, v) == ("epochs", 0) else "")
            for k, v in regime.items()
        )
    return "–" if regime is None else str(regime)


def _summary(rows: Sequence[tuple[Finding, Outcome]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for key in (*PAPERS, "all"):
        sel = [o for f, o in rows if key in ("all", f.paper)]
        out[key] = {v: sum(1 for o in sel if o.verdict == v) for v in VERDICTS}
    return out


def _convergence(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per encoder and variant: best epoch (validation rsum peak) and epochs run, [mean, std] or None."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for enc in ENCODERS:
        report = reports.get(enc)
        if not isinstance(report, Mapping):
            continue
        out[enc] = {
            name: {
                key: as_mean_std(entry.get(key)) if isinstance(entry, Mapping) else None
                for key in ("best_epoch", "epochs_completed")
            }
            for name, entry in (report.get("variants") or {}).items()
        }
    return out


def _cost_lines(cost: Mapping[str, Any]) -> list[str]:
    md = [
        "## Cost",
        "",
        "CPU seconds per finished run (training runs one thread, so these are core-seconds whatever "
        "else shared the cores). Runs that recorded only wall seconds are converted at the encoder's "
        "CPU/wall ratio over the runs that recorded both; a resumed run's training is scaled to all "
        "its epochs (where it recorded how many it trained: older resumed runs undercount). "
        "Variants without a finished run are projected at their encoder's median run "
        "(SmoothAP: times its epoch factor).",
        "",
        "| encoder | variant | finished runs (CPU-timed) | CPU s per run | projected CPU s per run |",
        "|---|---|---:|---:|---:|",
    ]
    for enc, per in cost["encoders"].items():
        for name, row in per["variants"].items():
            cells = [_fmt(row["seconds_per_run"]), _fmt(row["projected_per_run"])]
            counts = f"{row['finished']} ({row['with_cpu_seconds']})"
            md.append(f"| {enc} | `{name}` | {counts} | " + " | ".join(cells) + " |")
    hours = cost["projected_core_hours"]
    ratios = ", ".join(
        f"{enc} {per['cpu_per_wall']:.2f}" for enc, per in cost["encoders"].items() if per["cpu_per_wall"]
    )
    md += [
        "",
        f"CPU/wall ratios: {ratios or 'none measured'}. **The whole table** ({cost['seeds']} seeds of "
        f"every variant): about {hours:.1f} core-hours, so about {hours / 2:.1f} hours on 2 cores "
        "running two single-threaded runs at a time.",
        "",
    ]
    return md


def build_findings(
    reports: Mapping[str, Mapping[str, Any]],
    regime_notes: str = "",
    findings: Sequence[Finding] = FINDINGS,
    cost: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """Evaluate ``findings`` on ``{"vsepp": report, "gpo": report}`` (either may be missing).

    Returns (JSON-able dict, markdown). ``regime_notes`` is the text of the markdown's last section,
    "What differs in the regime"; ``cost`` (:func:`~icr.training.analysis.paper_regime.suite_cost`),
    when given, adds a section on what the runs cost.
    """
    rows = [(f, evaluate(f, reports)) for f in findings]
    present = [enc for enc in ENCODERS if isinstance(reports.get(enc), Mapping)]
    commands = {enc: reports[enc].get("command") for enc in present}
    summary = _summary(rows)
    convergence = _convergence(reports)

    md = ["# Paper findings on the embedded benchmark", ""]
    if not present:
        md += ["No reports were given: every finding is *not run*.", ""]
    for enc in present:
        md += [f"- `{enc}`: produced by `{commands[enc] or '(command not recorded)'}`"]
    md += [""]
    for enc in present:
        md += [f"Regime ({enc}): {_regime_text(reports[enc])}.", ""]
    md += [
        "Each row is a claim of a paper, its numbers (as printed; `*` marks a number read from a cell "
        "whose structure the conversion lost, or computed from printed ones), ours (mean ± sample std "
        "over seeds, from the comparison report of the named encoder), the test of our difference "
        "(its estimate, 90 % interval, which matches one-sided tests at 0.05, degrees of freedom and "
        "the p-value behind the verdict) and the "
        "verdict. Only directions are compared, never levels: the papers train on Flickr30k, MS-COCO "
        "or Conceptual Captions, we on the embedded synthetic benchmark, and scales can differ (the "
        "Cross-Example Softmax paper prints PR-AUC in percent, we on a 0-1 scale).",
        "",
        "## Verdict rule",
        "",
        VERDICT_RULE,
        "",
    ]
    for key, paper in PAPERS.items():
        sel = [(f, o) for f, o in rows if f.paper == key]
        if not sel:
            continue
        md += [
            f"## {paper.short}: {paper.title} ({paper.citation})",
            "",
            "| finding | paper's numbers | ours | test | verdict |",
            "|---|---|---|---:|---|",
        ]
        for f, o in sel:
            verdict = f"**{o.verdict}**" + (f"<br>{o.detail}" if o.detail else "")
            md.append(
                "| "
                + " | ".join(
                    _escape(c)
                    for c in (
                        _claim_cell(f),
                        _paper_cell(f),
                        _ours_cell(o),
                        _test_cell(o),
                        verdict,
                    )
                )
                + " |"
            )
        md.append("")
    md += [
        "## Summary",
        "",
        f"Testable findings only; {NOT_TESTABLE} and {NOT_RUN} rows are counted apart and listed above.",
        "",
        "| paper | " + " | ".join(TESTABLE) + f" | testable | {NOT_TESTABLE} | {NOT_RUN} |",
    ]
    md.append("|---|" + "---:|" * (len(TESTABLE) + 3))
    for key, counts in summary.items():
        label = "**all**" if key == "all" else PAPERS[key].short
        cells = [str(counts[v]) for v in TESTABLE]
        cells += [str(sum(counts[v] for v in TESTABLE)), str(counts[NOT_TESTABLE]), str(counts[NOT_RUN])]
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    md.append("")
    if any(ms is not None for per in convergence.values() for row in per.values() for ms in row.values()):
        md += ["## Convergence (mean ± std over seeds)", ""]
        md += [
            "| encoder | variant | best epoch (validation rsum peak) | epochs run |",
            "|---|---|---:|---:|",
        ]
        for enc, per in convergence.items():
            for name, row in per.items():
                cells = ["–" if ms is None else f"{ms[0]:.1f} ± {ms[1]:.1f}" for ms in row.values()]
                md.append(f"| {enc} | `{name}` | " + " | ".join(cells) + " |")
        md.append("")
    missing = [n for n in NUMBERS.values() if n.status == "missing"]
    if missing:
        md += ["## Paper numbers not in the markdown", ""]
        md += [f"- `{n.key}` ({PAPERS[n.paper].short} {n.table}): {n.note}" for n in missing]
        md.append("")
    if cost is not None:
        md += _cost_lines(cost)
    regime_rows = differences(reports)
    if regime_rows:
        md += regime_markdown(regime_rows, PAPERS)
    md += ["## What differs in the regime", "", regime_notes.strip() or "(not given)", ""]

    def number_json(key: str) -> dict[str, Any]:
        return asdict(NUMBERS[key])

    data: dict[str, Any] = {
        "verdict_rule": VERDICT_RULE,
        "commands": commands,
        "regimes": {enc: reports[enc].get("regime") for enc in present},
        "papers": {k: asdict(p) for k, p in PAPERS.items()},
        "findings": [
            {
                **{k: v for k, v in asdict(f).items() if k != "evidence"},
                "evidence": [[number_json(k) for k in group] for group in f.evidence],
                "verdict": o.verdict,
                "p": o.p,
                "test": o.test,
                "detail": o.detail,
                "ours": list(o.ours),
            }
            for f, o in rows
        ],
        "summary": summary,
        "convergence": convergence,
        "regime_differences": [asdict(r) for r in regime_rows],
        "regime_notes": regime_notes,
        "cost": cost,
    }
    return data, "\n".join(md)


def write_findings(
    reports: Mapping[str, Mapping[str, Any]],
    out_md: Path,
    out_json: Path,
    regime_notes: str,
    cost: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the findings and write the markdown and the JSON atomically; returns the JSON dict."""
    data, markdown = build_findings(reports, regime_notes, cost=cost)
    atomic_write_text(out_json, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(out_md, markdown)
    return data


def load_reports(paths: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """``{"vsepp": report.json path, ...}`` -> the parsed reports; absent files are left out."""
    return {enc: json.loads(Path(p).read_text()) for enc, p in paths.items() if Path(p).is_file()}


__all__ = ["build_findings", "load_reports", "write_findings"]
