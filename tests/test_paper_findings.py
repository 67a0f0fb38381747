"""Paper findings: the verdict rule against a naive computation written here, the transcribed paper
numbers against the markdown papers (skipped when ../shared/papers is absent), the findings' references
(paper numbers, variant names, metric paths) and build_findings / write_findings on synthetic reports."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from icr.training.analysis import paper_numbers as pn
from icr.training.analysis.cocos import SYMBOLS
from icr.training.analysis.compare import CALIBRATION_COLUMNS, MAIN_COLUMNS, TRUTH_COLUMNS
from icr.training.analysis.findings_catalogue import FINDINGS
from icr.training.analysis.findings_report import build_findings, write_findings
from icr.training.analysis.findings_verdict import (
    ABOVE,
    ANTI_RANKED,
    AT_LEAST,
    BELOW,
    DIFFERS,
    EQUALS,
    GREATER,
    INVERTED,
    MIXED,
    NOT_RUN,
    ONE_SEED,
    PAIRWISE,
    REPRODUCED,
    SINGLE,
    VERDICTS,
    WITHIN_NOISE,
    Finding,
    evaluate,
)
from icr.training.losses.goal import PAIR_WEIGHTS, TRIPLET_WEIGHTS

OUR_VARIANTS = {
    "triplet",
    "triplet_hardest",
    "ntxent",
    "smoothap",
    "sampled_softmax",
    "cross_example_softmax",
    "cross_example_mining",
    "snm",
    "ntxent+ltd:dual",
    "ntxent+ltd:constraint",
    "ntxent+itd:constraint",
}
GOAL_NAME = re.compile(r"^goal\[triplet_weight=(\w+),pair_weight=(\w+)\]$")
PAPERS_DIR = pn.papers_dir(Path(__file__).resolve().parents[1])


# --- the verdict rule, naively ------------------------------------------------------------------------
def naive_verdict(kind: str, a: tuple[float, float], b: tuple[float, float]) -> tuple[str, float]:
    """The rule as the issue states it, written out without the module's helpers."""
    d = a[0] - b[0]
    s = ((a[1] ** 2 + b[1] ** 2) / 2) ** 0.5
    if s == 0:
        s = 1e-9
    margin = min(1000.0, max(-1000.0, d / s))
    if kind == GREATER:
        verdict = (
            "reproduced" if margin >= 1 else "inverted" if margin <= -1 else "not reproduced (within noise)"
        )
    elif kind == AT_LEAST:
        verdict = "inverted" if margin <= -1 else "reproduced"
    else:
        verdict = "reproduced" if abs(margin) < 1 else "not reproduced (differs)"
    return verdict, margin


def report(values: dict[str, dict[str, Any]], runs: int = 3, **extra: Any) -> dict[str, Any]:
    """A compare-style report: ``values[variant]["annotations/rsum"] = [mean, std]`` and so on."""
    variants: dict[str, Any] = {}
    for name, metrics in values.items():
        entry: dict[str, Any] = {"runs": runs}
        for path, value in metrics.items():
            node = entry
            *parents, leaf = path.split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        variants[name] = entry
    return {
        "command": "icr analyze compare --test",
        "regime": {"epochs": 30, "batch_size": 128},
        "variants": variants,
        **extra,
    }


def pair_finding(kind: str, metric: str = "annotations/rsum", encoder: str = "vsepp") -> Finding:
    return Finding(
        "test",
        "ecir",
        "Table 1",
        "A vs B",
        encoder,
        kind,
        ("triplet_hardest", "ntxent"),
        (metric,),
        (("ecir.t1.f30k.vsepp.triplet_sh.rsum", "ecir.t1.f30k.vsepp.ntxent.rsum"),),
    )


CASES = [  # (A, B): reproduced, inverted, within noise, exactly equal, zero std both ways
    ((350.0, 2.0), (330.0, 3.0)),
    ((300.0, 2.0), (330.0, 3.0)),
    ((331.0, 2.0), (330.0, 3.0)),
    ((330.0, 1.0), (330.0, 1.0)),
    ((1.0, 0.0), (0.5, 0.0)),
    ((0.5, 0.0), (1.0, 0.0)),
    ((2.0, 0.0), (2.0, 0.0)),
    ((10.0, 1.0), (9.0, 1.0)),  # margin exactly 1
    ((9.0, 1.0), (10.0, 1.0)),  # margin exactly -1
]


@pytest.mark.parametrize("kind", PAIRWISE)
@pytest.mark.parametrize(("a", "b"), CASES)
def test_pairwise_verdicts_match_the_naive_rule(
    kind: str, a: tuple[float, float], b: tuple[float, float]
) -> None:
    reports = {
        "vsepp": report(
            {"triplet_hardest": {"annotations/rsum": list(a)}, "ntxent": {"annotations/rsum": list(b)}}
        )
    }
    out = evaluate(pair_finding(kind), reports)
    verdict, margin = naive_verdict(kind, a, b)
    assert out.verdict == verdict
    assert out.margin == pytest.approx(margin)
    assert [o["mean"] for o in out.ours] == [a[0], b[0]]


def test_zero_std_gives_a_capped_margin() -> None:
    reports = {
        "vsepp": report(
            {"triplet_hardest": {"annotations/rsum": [1.0, 0.0]}, "ntxent": {"annotations/rsum": [0.5, 0.0]}}
        )
    }
    out = evaluate(pair_finding(GREATER), reports)
    assert (out.verdict, out.margin) == (REPRODUCED, 1000.0)
    _, md = build_findings(reports)
    assert "+∞ (std 0)" in md


def test_two_single_seed_sides_are_not_decided() -> None:
    """With one seed on each side the zero stds say nothing about noise: no verdict, the difference shown."""
    values = {"triplet_hardest": {"annotations/rsum": [1.0, 0.0]}, "ntxent": {"annotations/rsum": [0.5, 0.0]}}
    out = evaluate(pair_finding(GREATER), {"vsepp": report(values, runs=1)})
    assert (out.verdict, out.margin, out.detail) == (ONE_SEED, None, "difference +0.5")
    _, md = build_findings({"vsepp": report(values, runs=1)})
    assert ONE_SEED in md


@pytest.mark.parametrize(
    ("reports", "why"),
    [
        ({}, "no vsepp report"),
        ({"gpo": report({"triplet_hardest": {"annotations/rsum": [1, 0]}})}, "no vsepp report"),
        (
            {"vsepp": report({"triplet_hardest": {"annotations/rsum": [1.0, 0.1]}})},
            "ntxent not in the vsepp report",
        ),
        (
            {
                "vsepp": report(
                    {
                        "triplet_hardest": {"annotations/rsum": [1.0, 0.1]},
                        "ntxent": {"annotations/rsum": None},
                    }
                )
            },
            "ntxent: annotations/rsum is null",
        ),
        (
            {
                "vsepp": report(
                    {
                        "triplet_hardest": {"annotations/rsum": [1.0, 0.1]},
                        "ntxent": {"annotations/rsum": [math.nan, 0.0]},
                    }
                )
            },
            "ntxent: annotations/rsum is null",
        ),
        (
            {"vsepp": report({"triplet_hardest": {"annotations/rsum": [1.0, 0.1]}, "ntxent": {"cocos": {}}})},
            "ntxent: no annotations/rsum",
        ),
    ],
)
def test_absent_data_is_not_run(reports: dict[str, Any], why: str) -> None:
    out = evaluate(pair_finding(GREATER), reports)
    assert out.verdict == NOT_RUN and out.margin is None
    assert why in out.detail


@pytest.mark.parametrize(
    ("kind", "mean", "verdict"),
    [
        (EQUALS, 1.0, REPRODUCED),
        (EQUALS, 1.4, REPRODUCED),
        (EQUALS, 1.6, DIFFERS),
        (EQUALS, 0.4, DIFFERS),
        (ABOVE, 1.6, REPRODUCED),
        (ABOVE, 1.2, WITHIN_NOISE),
        (ABOVE, 0.4, INVERTED),
        (BELOW, 0.4, REPRODUCED),
        (BELOW, 0.8, WITHIN_NOISE),
        (BELOW, 1.6, INVERTED),
    ],
)
def test_single_quantities_use_the_stated_tolerance(kind: str, mean: float, verdict: str) -> None:
    finding = Finding(
        "one", "ecir", "Table 2", "x vs 1", "gpo", kind, ("triplet",), ("cocos/i2t_Cq",),
        (("ecir.t2.f30k.vsrn.triplet.i2t_Cq",),), target=1.0, tolerance=0.5,
    )  # fmt: skip
    out = evaluate(finding, {"gpo": report({"triplet": {"cocos/i2t_Cq": [mean, 0.2]}})})
    assert out.verdict == verdict
    assert out.margin == pytest.approx((mean - 1.0) / 0.2)


def naive_anti_ranked(count: dict[str, tuple[float, float]], score: dict[str, tuple[float, float]]) -> str:
    concordant = discordant = 0
    for a, b in itertools.combinations(count, 2):
        _, mx = naive_verdict(GREATER, count[a], count[b])
        _, my = naive_verdict(GREATER, score[a], score[b])
        if abs(mx) >= 1 and abs(my) >= 1:
            if (mx > 0) == (my > 0):
                discordant += 1
            else:
                concordant += 1
    if concordant and discordant:
        return MIXED
    return REPRODUCED if concordant else INVERTED if discordant else WITHIN_NOISE


@pytest.mark.parametrize(
    "scores",
    [
        {"triplet": (300.0, 1.0), "triplet_hardest": (350.0, 1.0), "smoothap": (340.0, 1.0)},  # as the paper
        {"triplet": (360.0, 1.0), "triplet_hardest": (300.0, 1.0), "smoothap": (320.0, 1.0)},  # reversed
        {"triplet": (300.0, 1.0), "triplet_hardest": (350.0, 1.0), "smoothap": (360.0, 1.0)},  # mixed
        {"triplet": (300.0, 50.0), "triplet_hardest": (301.0, 50.0), "smoothap": (302.0, 50.0)},  # noise
    ],
)
def test_anti_ranked_matches_a_pairwise_count(scores: dict[str, tuple[float, float]]) -> None:
    counts = {"triplet": (6.0, 0.5), "triplet_hardest": (1.0, 0.0), "smoothap": (1.3, 0.05)}
    finding = next(f for f in FINDINGS if f.kind == ANTI_RANKED and f.encoder == "vsepp")
    values = {v: {"cocos/i2t_Cq": list(counts[v]), "annotations/rsum": list(scores[v])} for v in counts}
    out = evaluate(finding, {"vsepp": report(values)})
    assert out.verdict == naive_anti_ranked(counts, scores)
    assert out.margin is None and "of 3 pairs" in out.detail


# --- the findings' references ----------------------------------------------------------------------
def test_findings_reference_existing_numbers_variants_and_metrics() -> None:
    columns = {
        "annotations": {c for c, _, _ in MAIN_COLUMNS},
        "ground_truth": {c for c, _, _ in TRUTH_COLUMNS},
        "calibration": {c for c, _, _ in CALIBRATION_COLUMNS},
        "cocos": {f"{d}_{k}" for d in ("i2t", "t2i") for k in SYMBOLS},
    }
    assert len({f.id for f in FINDINGS}) == len(FINDINGS)
    papers_seen = set()
    for f in FINDINGS:
        papers_seen.add(f.paper)
        assert f.paper in pn.PAPERS and f.encoder in ("vsepp", "gpo")
        assert f.evidence and all(k in pn.NUMBERS for k in f.paper_keys()), f.id
        assert all(pn.NUMBERS[k].paper == f.paper for k in f.paper_keys()), f.id
        for v in f.variants:
            match = GOAL_NAME.match(v)
            if match:
                assert match.group(1) in TRIPLET_WEIGHTS and match.group(2) in PAIR_WEIGHTS, v
                assert f.encoder == "gpo", f.id
            else:
                assert v in OUR_VARIANTS, (f.id, v)
        for m in f.metrics:
            section, _, name = m.partition("/")
            assert name in columns[section], (f.id, m)
        if f.kind in PAIRWISE:
            assert len(f.variants) == 2 and len(f.metrics) in (1, 2)
            assert all(len(group) == 2 for group in f.evidence), f.id
        elif f.kind in SINGLE:
            assert len(f.variants) == 1 and f.target is not None and f.tolerance is not None
        else:
            assert len(f.variants) >= 2 and len(f.metrics) == 2
    assert papers_seen == set(pn.PAPERS)


def test_paper_numbers_are_well_formed() -> None:
    for n in pn.NUMBERS.values():
        assert n.status in ("ok", "inferred", "derived", "missing")
        assert (n.mean is None) == (n.status == "missing"), n.key
        if n.status == "missing":
            assert n.note, n.key
    # spot checks (the markdown tests below check every transcribed cell)
    assert pn.number("ecir.t1.f30k.vsrn.triplet_sh.i2t_r1").text() == "68.3 ± 1.3"
    assert pn.number("ecir.t1.coco.vsepp.triplet_sh.rsum").mean == 298.8
    assert pn.number("ecir.t2.f30k.vsepp.triplet.i2t_CB").text() == "768.92 ± 96.87"
    assert pn.number("ltd.t1.f30k.ltd_lag.rsum").mean == pytest.approx(
        49.7 + 78.9 + 86.7 + 37.5 + 68.6 + 79.5
    )
    assert pn.number("ces.t1.cc.ce_softmax.pr_auc").mean == 20.12
    assert pn.number("goal.t5.coco.vseinf_butd.cir.sig_ms.i2t_r1").text() == "63.2 ± 0.3"
    with pytest.raises(KeyError, match="no paper number"):
        pn.number("ecir.t9")


# --- the transcription against the markdown ------------------------------------------------------------
def paper_lines(key: str) -> list[str]:
    path = PAPERS_DIR / pn.PAPERS[key].file
    if not path.is_file():
        pytest.skip(f"{path} is absent (the papers live in ../shared/papers)")
    return path.read_text(encoding="utf-8").splitlines()


PM = re.compile(r"(\d+(?:\.\d+)?)\s*±\s*(\d*\.\d+|\d+)")


def pm_pairs(text: str) -> list[tuple[float, float]]:
    """Every "mean ± std" in a line of LaTeX / HTML-flavoured markdown."""
    for token in ("\\textbf", "$", "{", "}", "\\ ", "~"):
        text = text.replace(token, " " if token == "\\ " else "")
    text = re.sub(r"<[^>]+>", "", text).replace("\\pm", "±")
    return [(float(m), float(s)) for m, s in PM.findall(text)]


def block(lines: list[str], start: str, stop: str) -> list[str]:
    i = next(k for k, line in enumerate(lines) if start in line)
    j = next(k for k in range(i + 1, len(lines)) if stop in lines[k])
    return lines[i + 1 : j]


def transcribed(prefix: str) -> list[tuple[float, float]]:
    return [
        (n.mean, n.std)
        for n in pn.NUMBERS.values()
        if n.key.startswith(prefix) and n.mean is not None and n.std is not None and n.status != "derived"
    ]


def test_ecir_table1_rows_match_the_markdown() -> None:
    lines = block(paper_lines("ecir"), "Table 1: Evaluation scores", "experiment number (#)")
    rows = [pairs for pairs in (pm_pairs(line) for line in lines) if len(pairs) >= 10]
    assert len(rows) == 16
    for (row, cells), printed in zip(pn.ECIR_T1.items(), rows, strict=True):
        ds, method, loss = pn.ecir_row(row)
        ours = [
            (
                pn.number(f"ecir.t1.{ds}.{method}.{loss}.{c}").mean,
                pn.number(f"ecir.t1.{ds}.{method}.{loss}.{c}").std,
            )
            for c in pn.ECIR_T1_COLUMNS
        ]
        assert ours == printed, row
        assert len(cells.split()) == 10


@pytest.mark.parametrize(
    ("prefix", "start", "stop", "count"),
    [
        ("ecir.t2.", "Experimental outcomes", "Table 2: COCOS", 48),
        ("ecir.t3.", "consistently outperforms the NT-Xent", "Table 3: COCOS", 14),
        ("ecir.t4.", "Table 4:", "loss, regardless of the method", 16),
    ],
)
def test_ecir_cocos_tables_match_the_markdown(prefix: str, start: str, stop: str, count: int) -> None:
    printed = [p for line in block(paper_lines("ecir"), start, stop) for p in pm_pairs(line)]
    assert len(printed) == count
    assert Counter(transcribed(prefix)) == Counter(printed)


def test_ecir_table3_flickr_rows_are_lost_in_the_markdown() -> None:
    lines = block(paper_lines("ecir"), "consistently outperforms the NT-Xent", "Table 3: COCOS")
    flickr = next(line for line in lines if line.startswith("Flickr30k"))
    assert pm_pairs(flickr) == [(0.56, 0.02), (0.20, 0.02)]
    assert flickr.split("\t").index(next(c for c in flickr.split("\t") if "0.56" in c)) == 5  # i2t W^{qv+}
    lost = [n for n in pn.missing() if n.key.startswith("ecir.t3.f30k.")]
    assert len(lost) == 10


def test_ltd_table1_matches_the_markdown() -> None:
    lines = block(paper_lines("ltd"), "Table 1: Recall@k and r-precision", "on Table 1, row 1.1")
    for ds, row, name, cells in pn.LTD_T1:
        line = next(line for line in lines if line.startswith(f"{row}\t"))
        assert line.split("\t")[-8:] == cells.split(), row
        assert pn.LTD_ROWS[name].split(",")[0] == line.split("\t")[1], row
        for col, cell in zip(pn.LTD_T1_COLUMNS, cells.split(), strict=True):
            assert pn.number(f"ltd.t1.{ds}.{name}.{col}").mean == (None if cell == "-" else float(cell))


def test_ces_tables_match_the_markdown() -> None:
    lines = paper_lines("ces")
    labels = {name: label for name, label in pn.CES_MODELS.items() if not name.startswith("ce_")}
    for table, rows, occurrence in (("t1.cc", pn.CES_T1, 0), ("t2.f30k", pn.CES_T2, 1)):
        for name, cells in rows:
            if name in labels:
                found = [line for line in lines if line.startswith(labels[name] + "\t")]
                fields = found[occurrence if name != "vilbert" else 0].split("\t")[1:]
            else:  # the merged CE-Softmax / CE Negative Mining line: first value CE-Softmax
                merged = [line for line in lines if line.startswith("CE-Softmax CE Negative Mining\t")][
                    occurrence
                ]
                fields = [cell.split()[name == "ce_mining"] for cell in merged.split("\t")[1:]]
            assert fields == cells.split(), (table, name)
            cols = pn.CES_T1_COLUMNS if table == "t1.cc" else ("t2i_r1", "t2i_r5", "t2i_r10")
            assert [pn.number(f"ces.{table}.{name}.{c}").mean for c in cols] == [float(x) for x in fields]


def test_goal_tables_match_the_markdown() -> None:
    lines = paper_lines("goal")
    labels = {"con": "P con", "lin": "P lin", "sig": "P sig", "lin_ms": "P lin−ms", "sig_ms": "P sig−ms"}
    for table, methods in pn.GOAL_TABLES.items():
        for method, rows in methods.items():
            start = lines.index(pn.GOAL_METHODS[method])
            printed = [
                line for line in lines[start + 1 : start + 12] if line.startswith("P ") and "±" in line
            ][:5]
            assert len(printed) == 5, method
            for (p, cells), line in zip(rows.items(), printed, strict=True):
                assert line == f"{labels[p]} {cells}", (table, method, p)
                assert [
                    pn.number(f"goal.t{table[-1]}.coco.{method}.{t}.{p}.i2t_r1").mean for t in pn.GOAL_T
                ] == [float(x) for x in cells.split()[0:9:3]]
    for method, who, cells in pn.GOAL_T2:
        label = {"vsepp_r152_ft": "VSE++(R152,FT)", "vseinf_butd": "VSE∞(BUTD)", "vseinf_wsl": "VSE∞(WSL)"}[
            method
        ]
        line = f"{label}{' ours' if who == 'ours' else ''} " + " ".join(
            f"{c.partition('±')[0]} ± {c.partition('±')[2]}" if "±" in c else c for c in cells.split()
        )
        assert line in lines, line


# --- build_findings / write_findings -----------------------------------------------------------------
def synthetic_reports() -> dict[str, dict[str, Any]]:
    vsepp = report(
        {
            "triplet": {
                "annotations/rsum": [300.0, 2.0],
                "cocos/i2t_Cq": [6.0, 0.5],
                "best_epoch": [20.0, 1.0],
            },
            "triplet_hardest": {"annotations/rsum": [350.0, 2.0], "cocos/i2t_Cq": [1.0, 0.0]},
            "ntxent": {"annotations/rsum": [351.0, 2.0]},  # within noise of SH
            "sampled_softmax": {"calibration/PR-AUC (annotations)": [0.30, 0.01]},
            "cross_example_softmax": {"calibration/PR-AUC (annotations)": [0.20, 0.01]},  # inverted
            "ntxent+ltd:constraint": {"annotations/rsum": [360.0, 2.0]},
        }
    )
    gpo = report(
        {
            "goal[triplet_weight=cir,pair_weight=sig_ms]": {"annotations/i2t R@1": [60.0, 0.5]},
            "goal[triplet_weight=con,pair_weight=con]": {"annotations/i2t R@1": [55.0, 0.5]},
        },
        command="icr analyze compare --encoder gpo",
    )
    return {"vsepp": vsepp, "gpo": gpo}


def by_id(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in data["findings"]}


def test_build_findings_on_synthetic_reports() -> None:
    data, md = build_findings(synthetic_reports(), "Synthetic images, 2 epochs.")
    found = by_id(data)
    assert found["ecir-t1-sh-beats-triplet-vsepp"]["verdict"] == REPRODUCED
    assert found["ecir-t1-sh-beats-triplet-vsepp"]["margin"] == pytest.approx(25.0)
    assert found["ecir-t1-sh-beats-ntxent-vsepp"]["verdict"] == WITHIN_NOISE
    assert found["ecir-t1-ntxent-beats-triplet-vsepp"]["verdict"] == REPRODUCED
    assert found["ecir-t2-triplet-counts-more-i2t-vsepp"]["verdict"] == REPRODUCED
    assert found["ecir-t2-sh-cq-is-one-vsepp"]["verdict"] == REPRODUCED
    assert found["ces-t1-ces-calibrates-vsepp"]["verdict"] == INVERTED
    assert found["ltd-t1-constraint-beats-baseline-vsepp"]["verdict"] == REPRODUCED
    assert found["ltd-t1-ltd-beats-itd-vsepp"]["verdict"] == NOT_RUN
    assert found["goal-t5-cir-sigms-beats-con-con-i2t-gpo"]["verdict"] == REPRODUCED
    assert found["ecir-t1-sh-beats-triplet-gpo"]["verdict"] == NOT_RUN
    evidence = found["ecir-t1-sh-beats-triplet-vsepp"]["evidence"]
    assert [[n["mean"] for n in group] for group in evidence] == [[353.8, 309.4], [298.8, 240.0]]
    counts = data["summary"]["all"]
    assert sum(counts.values()) == len(FINDINGS) and set(counts) == set(VERDICTS)
    assert counts[REPRODUCED] >= 6 and counts[INVERTED] >= 1
    assert data["commands"] == {
        "vsepp": "icr analyze compare --test",
        "gpo": "icr analyze compare --encoder gpo",
    }
    assert data["convergence"]["vsepp"]["triplet"] == {"best_epoch": (20.0, 1.0), "epochs_completed": None}
    json.dumps(data)  # JSON-able
    # markdown: the command, the rule, one table per paper, the summary, the regime notes at the end
    assert "`icr analyze compare --test`" in md and "## Verdict rule" in md
    for paper in pn.PAPERS.values():
        heading = f"## {paper.short}: "
        assert heading in md
        after = md.split(heading, 1)[1].splitlines()
        assert after[2] == "| finding | paper's numbers | ours | margin (stds) | verdict |"
    rows = [line for line in md.splitlines() if re.match(r"\| \*\*[a-z0-9]+-", line)]
    assert len(rows) == len(FINDINGS)
    assert all(line.count(" | ") == 4 for line in rows)  # no stray pipe in a cell
    assert "| **all** |" in md
    assert md.rstrip().endswith("## What differs in the regime\n\nSynthetic images, 2 epochs.")


def test_build_findings_without_reports_does_not_crash() -> None:
    data, md = build_findings({})
    assert {f["verdict"] for f in data["findings"]} == {NOT_RUN}
    assert "every finding is *not run*" in md


def test_write_findings_writes_both_files(tmp_path: Path) -> None:
    out_md, out_json = tmp_path / "docs" / "paper-findings.md", tmp_path / "docs" / "paper-findings.json"
    data = write_findings(synthetic_reports(), out_md, out_json, "Notes.")
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(data))
    assert out_md.read_text().startswith("# Paper findings")
    assert sorted(p.name for p in out_md.parent.iterdir()) == ["paper-findings.json", "paper-findings.md"]


def test_suite_cost_counts_cpu_seconds_and_projects_the_missing_variants(tmp_path: Path) -> None:
    """suite_cost against sums written out by hand: CPU seconds where a run recorded them, wall
    seconds converted at the encoder's CPU/wall ratio where not, a resumed run's training scaled to
    all its epochs, the encoder's median run for variants with none (SmoothAP times the factor)."""
    from icr.training.analysis.paper_regime import SUITES, suite_cost

    def result(variant: str, seed: int, wall: float, cpu: float | None, resumed: bool = False) -> None:
        run = tmp_path / "vsepp" / variant / f"seed{seed}"
        run.mkdir(parents=True)
        doc: dict[str, Any] = {
            "variant": variant,
            "epochs_completed": 10,
            "seconds": {"train": wall - 10, "evaluate": 6, "cocos": 4},
        }
        if cpu is not None:  # recorded since CPU time was, with the epochs this process trained
            doc["cpu_seconds"] = {"train": cpu - 3, "evaluate": 2, "cocos": 1}
            doc["epochs_this_run"] = 5 if resumed else 10
        (run / "result.json").write_text(json.dumps(doc))

    result("triplet", 0, wall=510, cpu=None)  # before CPU time: wall x (CPU/wall ratio 0.5) = 255
    result("triplet", 1, wall=600, cpu=300)
    result("ntxent", 0, wall=400, cpu=200)
    result("snm", 0, wall=110, cpu=53, resumed=True)  # trained 5 of 10 epochs: (53 - 3) x 2 + 3
    cost = suite_cost(tmp_path, seeds=3, smoothap_factor=5)

    vsepp = cost["encoders"]["vsepp"]
    # the ratio from runs with both, each scaled alike: (300 + 200 + 103) / (600 + 400 + 210)
    ratio = (300 + 200 + 103) / (600 + 400 + 210)
    assert vsepp["cpu_per_wall"] == pytest.approx(ratio)
    triplet = vsepp["variants"]["triplet"]
    assert (triplet["finished"], triplet["with_cpu_seconds"]) == (2, 1)
    assert triplet["seconds_per_run"] == pytest.approx((510 * ratio + 300) / 2)
    assert vsepp["variants"]["snm"]["seconds_per_run"] == pytest.approx(103)
    costs = sorted([510 * ratio, 300, 200, 103])
    median = (costs[1] + costs[2]) / 2
    assert vsepp["median_run_seconds"] == pytest.approx(median)
    assert vsepp["variants"]["cross_example_softmax"]["projected_per_run"] == pytest.approx(median)
    assert vsepp["variants"]["smoothap"]["projected_per_run"] == pytest.approx(5 * median)
    assert cost["encoders"]["gpo"]["median_run_seconds"] is None  # nothing run: nothing projected
    n_other = len(SUITES["vsepp"][1]) - 4  # triplet, ntxent, snm measured; smoothap at 5x
    expected = 3 * ((510 * ratio + 300) / 2 + 200 + 103 + 5 * median + median * n_other) / 3600
    assert cost["projected_core_hours"] == pytest.approx(expected)

    _, md = build_findings(synthetic_reports(), cost=cost)
    assert "## Cost" in md and "| vsepp | `ntxent` | 1 (1) | 200.0 | 200.0 |" in md
    assert f"about {expected:.1f} core-hours" in md
