"""Paper findings: the verdict rule against a naive computation written here (scipy's t tests), the
transcribed paper numbers against the markdown papers (skipped when ../shared/papers is absent), the
findings' references (paper numbers, variant names, metric paths), build_findings / write_findings on
synthetic reports, the regime differences and the papers' stopping rule."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats as scipy_stats

from icr.training.analysis import paper_numbers as pn
from icr.training.analysis.cocos import SYMBOLS
from icr.training.analysis.compare import CALIBRATION_COLUMNS, MAIN_COLUMNS, TRUTH_COLUMNS
from icr.training.analysis.findings_catalogue import FINDINGS
from icr.training.analysis.findings_report import build_findings, write_findings
from icr.training.analysis.findings_verdict import (
    ABOVE,
    ALPHA,
    ANTI_RANKED,
    AT_LEAST,
    BELOW,
    BEST_ALSO,
    EQUALS,
    EQUIVALENCE,
    GREATER,
    INCONCLUSIVE,
    INVERTED,
    MIN_SEEDS,
    NOT_REPRODUCED,
    NOT_RUN,
    NOT_TESTABLE,
    PAIRWISE,
    REPRODUCED,
    SIMILAR,
    SINGLE,
    TESTABLE,
    VERDICTS,
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
    "ntxent+itd:dual",
    "ntxent+itd:constraint",
    "ntxent[temperature=0.05]",
    "ntxent[temperature=0.05]+ltd:constraint",
}
GOAL_NAME = re.compile(r"^goal\[triplet_weight=(\w+),pair_weight=(\w+)\]$")
PAPERS_DIR = pn.papers_dir(Path(__file__).resolve().parents[1])


# --- the verdict rule, naively ------------------------------------------------------------------------
def naive_pairwise(kind: str, a: list[float], b: list[float]) -> str:
    """The rule as the issue states it, with scipy's paired t test standing in for ours: one-sided
    tests, TOST within 2 % of the larger mean, and fewer than 5 seeds deciding only beyond the spread."""
    n = min(len(a), len(b))
    d = statistics.fmean(a) - statistics.fmean(b)
    bound = 0.02 * max(abs(statistics.fmean(a)), abs(statistics.fmean(b)))
    spread = max(a) - min(a) + max(b) - min(b)

    def p(alternative: str, shift: float) -> float:  # H1: A - B (alternative) shift
        return float(scipy_stats.ttest_rel(np.array(a) - shift, b, alternative=alternative).pvalue)

    def decides(p_value: float, distance: float) -> bool:
        return p_value < 0.05 and (n >= 5 or distance > spread)

    tost = max(p("greater", -bound), p("less", bound))
    if kind == GREATER:
        if decides(p("greater", 0), d):
            return REPRODUCED
        if decides(p("less", 0), -d):
            return INVERTED
        return NOT_REPRODUCED if decides(tost, bound - abs(d)) else INCONCLUSIVE
    if kind == AT_LEAST:
        if decides(p("greater", -bound), d + bound):
            return REPRODUCED
        return INVERTED if decides(p("less", -bound), -(d + bound)) else INCONCLUSIVE
    if decides(tost, bound - abs(d)):
        return REPRODUCED
    beyond = min(p("greater", bound), p("less", -bound))
    return NOT_REPRODUCED if decides(beyond, abs(d) - bound) else INCONCLUSIVE


def _put(root: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split("/")
    for part in parents:
        root = root.setdefault(part, {})
    root[last] = value


def report(
    values: dict[str, dict[str, Any]], seeds: dict[str, list[int]] | None = None, **extra: Any
) -> dict[str, Any]:
    """A compare-style report: ``values[variant]["annotations/rsum"] = [one value per seed]`` (or None)
    gives that variant's ``per_seed`` lists, its ``seeds`` (0, 1, ... unless ``seeds`` names them) and
    the [mean, std] entry."""
    variants: dict[str, Any] = {}
    for name, metrics in values.items():
        n = max((len(v) for v in metrics.values() if isinstance(v, list)), default=0)
        entry: dict[str, Any] = {"runs": n, "seeds": (seeds or {}).get(name, list(range(n))), "per_seed": {}}
        for path, value in metrics.items():
            _put(entry["per_seed"], path, value)
            _put(entry, path, [float(np.mean(value)), float(np.std(value))] if value else None)
        variants[name] = entry
    return {
        "command": "icr analyze compare --test",
        "regime": {"epochs": 30, "batch_size": 128},
        "variants": variants,
        **extra,
    }


def pair_finding(kind: str, metric: str = "annotations/rsum", encoder: str = "vsepp", **kw: Any) -> Finding:
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
        **kw,
    )


def two(a: list[float], b: list[float], metric: str = "annotations/rsum") -> dict[str, Any]:
    return {"vsepp": report({"triplet_hardest": {metric: a}, "ntxent": {metric: b}})}


NOISE = [0.0, 1.3, -0.7, 2.1, -1.9]
CASES = [  # (A, B) per seed
    ([350 + e for e in NOISE], [330 - e / 2 for e in NOISE]),  # A clearly above, 5 seeds
    ([300 + e for e in NOISE], [330 - e / 2 for e in NOISE]),  # A clearly below
    ([330.4 + e for e in NOISE], [330 - e / 5 for e in NOISE]),  # equal within 2 %
    ([331 + 9 * e for e in NOISE], [330 - 8 * e for e in NOISE]),  # noise
    ([340.0, 341.5, 338.7], [330.0, 345.2, 318.9]),  # 3 seeds, spreads overlap
    ([360.0, 361.5, 358.7], [330.0, 331.2, 328.9]),  # 3 seeds, beyond every spread
    ([330.0, 335.0, 325.0], [336.5, 341.0, 331.5]),  # 3 seeds, a small significant step
    ([322.0, 325.5, 320.7], [330.0, 331.2, 328.9]),  # 3 seeds, just below
]


@pytest.mark.parametrize("kind", PAIRWISE)
@pytest.mark.parametrize(("a", "b"), CASES)
def test_pairwise_verdicts_match_the_naive_rule(kind: str, a: list[float], b: list[float]) -> None:
    out = evaluate(pair_finding(kind), two(a, b))
    assert out.verdict == naive_pairwise(kind, a, b)
    assert out.test is not None and out.test["name"] == "paired t" and out.test["n"] == [len(a), len(b)]
    assert out.test["estimate"] == pytest.approx(statistics.fmean(a) - statistics.fmean(b))
    assert [o["mean"] for o in out.ours] == pytest.approx([statistics.fmean(a), statistics.fmean(b)])
    assert [o["std"] for o in out.ours] == pytest.approx([statistics.stdev(a), statistics.stdev(b)])


def test_the_cases_cover_every_verdict_and_the_seed_rule() -> None:
    seen = {naive_pairwise(k, a, b) for k in PAIRWISE for a, b in CASES}
    assert seen == set(TESTABLE)
    overlap = evaluate(pair_finding(GREATER), two(*CASES[6]))  # significantly below, within the spread
    assert overlap.verdict == INCONCLUSIVE and overlap.test is not None
    held_back = r"inverted held back: p = [0-9.e-]+ < 0.05, but 3 seeds on a side and the effect"
    assert re.search(held_back, overlap.detail)
    assert scipy_stats.ttest_rel(*CASES[6], alternative="less").pvalue < ALPHA
    beyond = evaluate(pair_finding(GREATER), two(*CASES[5]))
    assert beyond.verdict == REPRODUCED and "exceeds every seed's spread combined" in beyond.detail
    assert MIN_SEEDS == 5 and EQUIVALENCE == 0.02


def test_a_stated_bound_replaces_the_default() -> None:
    a, b = CASES[0]  # A above B by about 20: equal within a bound of 40, not within 2 %
    assert evaluate(pair_finding(SIMILAR), two(a, b)).verdict == NOT_REPRODUCED
    wide = evaluate(pair_finding(SIMILAR, bound=40.0), two(a, b))
    assert wide.verdict == REPRODUCED and "δ 40" in wide.detail


def test_different_seed_sets_are_compared_by_welch() -> None:
    values = {
        "triplet_hardest": {"annotations/rsum": [350.0, 352.0, 351.0]},
        "ntxent": {"annotations/rsum": [330.0, 333.0]},
    }
    reports = {"vsepp": report(values, seeds={"ntxent": [0, 3]})}
    out = evaluate(pair_finding(GREATER), reports)
    assert out.test is not None and out.test["name"] == "Welch t" and out.test["n"] == [3, 2]
    expected = scipy_stats.ttest_ind(
        [350.0, 352.0, 351.0], [330.0, 333.0], equal_var=False, alternative="greater"
    )
    assert out.p == pytest.approx(expected.pvalue)


def test_one_seed_on_a_side_is_not_tested() -> None:
    out = evaluate(pair_finding(GREATER), two([1.0], [0.5]))
    assert (out.verdict, out.p, out.test) == (INCONCLUSIVE, None, None)
    assert out.detail == "fewer than 2 seeds on a side: no test (difference +0.5)"


@pytest.mark.parametrize(
    ("reports", "why"),
    [
        ({}, "no vsepp report"),
        ({"gpo": report({"triplet_hardest": {"annotations/rsum": [1.0, 2.0]}})}, "no vsepp report"),
        (
            {"vsepp": report({"triplet_hardest": {"annotations/rsum": [1.0, 1.1]}})},
            "ntxent not in the vsepp report",
        ),
        (two([1.0, 1.1], None), "ntxent: annotations/rsum is null"),  # type: ignore[arg-type]
        (two([1.0, 1.1], [math.nan, math.nan]), "ntxent: annotations/rsum is null"),
        (
            {
                "vsepp": report(
                    {"triplet_hardest": {"annotations/rsum": [1.0, 1.1]}, "ntxent": {"cocos/x": [1, 2]}}
                )
            },
            "ntxent: no annotations/rsum",
        ),
        (
            {"vsepp": {"variants": {"triplet_hardest": {"annotations": {"rsum": [1.0, 0.1]}}, "ntxent": {}}}},
            "no per-seed values (rebuild it with --report-only)",
        ),
    ],
)
def test_absent_data_is_not_run(reports: dict[str, Any], why: str) -> None:
    out = evaluate(pair_finding(GREATER), reports)
    assert out.verdict == NOT_RUN and out.p is None
    assert why in out.detail


@pytest.mark.parametrize("kind", SINGLE)
@pytest.mark.parametrize(
    "values",
    [
        [1.0, 1.1, 0.9, 1.05, 0.95],
        [1.6, 1.7, 1.5, 1.65, 1.55],
        [0.4, 0.5, 0.3, 0.45, 0.35],
        [1.2, 1.9, 0.6, 1.4],
    ],
)
def test_single_quantities_match_the_naive_one_sample_rule(kind: str, values: list[float]) -> None:
    finding = Finding(
        "one", "ecir", "Table 2", "x vs 1", "gpo", kind, ("triplet",), ("cocos/i2t_Cq",),
        (("ecir.t2.f30k.vsrn.triplet.i2t_Cq",),), target=1.0, tolerance=0.2,
    )  # fmt: skip
    out = evaluate(finding, {"gpo": report({"triplet": {"cocos/i2t_Cq": values}})})
    x, n = np.array(values), len(values)
    d, spread = x.mean() - 1.0, x.max() - x.min()

    def p(alternative: str, shift: float) -> float:
        return float(scipy_stats.ttest_1samp(x, 1.0 + shift, alternative=alternative).pvalue)

    def decides(p_value: float, distance: float) -> bool:
        return p_value < 0.05 and (n >= 5 or distance > spread)

    within = max(p("greater", -0.2), p("less", 0.2))
    if kind == EQUALS:
        beyond = min(p("greater", 0.2), p("less", -0.2))
        naive = (
            REPRODUCED
            if decides(within, 0.2 - abs(d))
            else NOT_REPRODUCED
            if decides(beyond, abs(d) - 0.2)
            else INCONCLUSIVE
        )
    else:
        sign = 1 if kind == ABOVE else -1
        toward, away = ("greater", "less") if sign > 0 else ("less", "greater")
        naive = (
            REPRODUCED if decides(p(toward, 0), sign * d)
            else INVERTED if decides(p(away, 0), -sign * d)
            else NOT_REPRODUCED if decides(within, 0.2 - abs(d))
            else INCONCLUSIVE
        )  # fmt: skip
    assert out.verdict == naive
    assert out.test is not None and out.test["name"] == "one-sample t"


def naive_anti_ranked(count: dict[str, list[float]], score: dict[str, list[float]]) -> str:
    concordant = discordant = 0
    for a, b in itertools.combinations(count, 2):
        signs = []
        for values in (count, score):
            x, y = values[a], values[b]
            d = statistics.fmean(x) - statistics.fmean(y)
            p = scipy_stats.ttest_rel(x, y).pvalue
            spread = max(x) - min(x) + max(y) - min(y)
            signs.append((1 if d > 0 else -1) if p < 0.05 and (len(x) >= 5 or abs(d) > spread) else 0)
        if all(signs):
            if signs[0] == signs[1]:
                discordant += 1
            else:
                concordant += 1
    if concordant and discordant:
        return NOT_REPRODUCED
    return REPRODUCED if concordant else INVERTED if discordant else INCONCLUSIVE


@pytest.mark.parametrize(
    "scores",
    [
        {"triplet": 300.0, "triplet_hardest": 350.0, "smoothap": 340.0},  # as the paper
        {"triplet": 360.0, "triplet_hardest": 300.0, "smoothap": 320.0},  # reversed
        {"triplet": 300.0, "triplet_hardest": 350.0, "smoothap": 360.0},  # mixed
        {"triplet": 300.0, "triplet_hardest": 300.5, "smoothap": 301.0},  # within noise
    ],
)
def test_anti_ranked_matches_a_pairwise_count(scores: dict[str, float]) -> None:
    counts = {"triplet": 6.0, "triplet_hardest": 1.0, "smoothap": 1.3}
    jitter = [0.0, 0.02, -0.01, 0.015, -0.02]
    count = {v: [counts[v] + (k + 1) * e for e in jitter] for k, v in enumerate(counts)}
    score = {
        v: [scores[v] + 40 * (k + 1) * e * (1 if i % 2 else -1) for i, e in enumerate(jitter)]
        for k, v in enumerate(scores)
    }
    finding = next(f for f in FINDINGS if f.kind == ANTI_RANKED and f.encoder == "vsepp")
    values = {v: {"cocos/i2t_Cq": count[v], "annotations/rsum": score[v]} for v in counts}
    out = evaluate(finding, {"vsepp": report(values)})
    assert out.verdict == naive_anti_ranked(count, score)
    assert out.p is None and "of 3 pairs" in out.detail


def test_a_collapsed_variant_and_untestable_claims_are_not_testable() -> None:
    values = {
        v: {"annotations/rsum": [340.0 + i, 345.0 - i, 338.0]}
        for i, v in enumerate(["ntxent", "triplet", "smoothap"])
    }
    values["triplet_hardest"] = {"annotations/rsum": [38.4, 42.0, 35.1], "cocos/i2t_Cq": [1.0, 1.0, 1.0]}
    out = evaluate(pair_finding(GREATER), {"vsepp": report(values)})
    assert out.verdict == NOT_TESTABLE and "triplet_hardest collapsed on vsepp (rsum 38.5" in out.detail
    healthy = Finding(
        "h", "ecir", "Table 1", "x", "vsepp", GREATER, ("ntxent", "triplet"), ("annotations/rsum",), ()
    )
    assert evaluate(healthy, {"vsepp": report(values)}).verdict != NOT_TESTABLE
    tautology = next(f for f in FINDINGS if f.id == "ecir-t2-sh-cq-is-one-gpo")
    assert tautology.untestable and evaluate(tautology, {}).verdict == NOT_TESTABLE


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


def _claim_holds_in_paper(f: Finding, group: tuple[float, ...]) -> bool:
    """The finding's claim, written out again on one setting's printed means."""
    bound = f.bound if f.bound is not None else EQUIVALENCE * max(group)
    if f.kind == GREATER:
        return group[0] > group[1]
    if f.kind == AT_LEAST:
        return group[0] >= group[1] - bound
    if f.kind == SIMILAR:
        return abs(group[0] - group[1]) <= bound
    assert f.target is not None and f.tolerance is not None, f.id
    if f.kind == EQUALS:
        return abs(group[0] - f.target) <= f.tolerance
    if f.kind == ABOVE:
        return group[0] > f.target
    assert f.kind == BELOW, f.id
    return group[0] < f.target


def test_every_claim_holds_in_the_papers_own_numbers_or_its_note_says_where_not() -> None:
    """A paraphrase stronger than the paper's table is caught here: each setting's printed means must
    bear the claim out, or the finding's note must quote the number that does not."""
    for f in FINDINGS:
        groups = [tuple(pn.NUMBERS[k].mean for k in g) for g in f.evidence]
        groups = [g for g in groups if None not in g]  # cells the paper does not print
        assert groups, f.id
        if f.kind == ANTI_RANKED:
            # evidence: the count groups, then the score groups, one per setting
            half = len(groups) // 2
            for counts, scores in zip(groups[:half], groups[half:], strict=True):
                for i, j in itertools.combinations(range(len(f.variants)), 2):
                    assert (counts[i] - counts[j]) * (scores[i] - scores[j]) < 0, (f.id, i, j)
        elif f.kind == BEST_ALSO:
            half = len(groups) // 2
            for first, second in zip(groups[:half], groups[half:], strict=True):
                best = max(range(len(first)), key=first.__getitem__)
                assert second[best] == max(second), f.id
        else:
            for g in groups:
                if not _claim_holds_in_paper(f, g):
                    assert f"{g[0]:.1f}" in f.note, (f.id, g, "the note must say where the paper differs")


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
    jitter = [0.0, 1.0, -1.0, 0.5, -0.5]

    def seeds(level: float, scale: float = 1.0) -> list[float]:
        return [level + scale * e for e in jitter]

    vsepp = report(
        {
            "triplet": {"annotations/rsum": seeds(300.0), "cocos/i2t_Cq": seeds(6.0, 0.2)},
            "triplet_hardest": {"annotations/rsum": seeds(350.0, 2.0), "cocos/i2t_Cq": [1.0] * 5},
            "ntxent": {"annotations/rsum": [351.0, 341.0, 361.0, 340.0, 362.0]},  # no clear order to SH
            "sampled_softmax": {"calibration/PR-AUC (annotations)": seeds(0.30, 0.01)},
            "cross_example_softmax": {"calibration/PR-AUC (annotations)": seeds(0.20, 0.01)},  # inverted
            "ntxent+ltd:constraint": {"annotations/rsum": seeds(380.0)},
        }
    )
    vsepp["variants"]["triplet"]["best_epoch"] = [20.0, 1.0]
    gpo = report(
        {
            "goal[triplet_weight=cir,pair_weight=sig_ms]": {"annotations/i2t R@1": seeds(60.0, 0.5)},
            "goal[triplet_weight=con,pair_weight=con]": {"annotations/i2t R@1": [55.0, 54.0, 56.0]},
        },
        command="icr analyze compare --encoder gpo",
    )
    return {"vsepp": vsepp, "gpo": gpo}


def by_id(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in data["findings"]}


def test_build_findings_on_synthetic_reports() -> None:
    data, md = build_findings(synthetic_reports(), "Synthetic images, 2 epochs.")
    found = by_id(data)
    sh_triplet = found["ecir-t1-sh-beats-triplet-vsepp"]
    assert sh_triplet["verdict"] == REPRODUCED and sh_triplet["test"]["name"] == "paired t"
    assert sh_triplet["test"]["estimate"] == pytest.approx(50.0) and sh_triplet["p"] < 0.001
    assert found["ecir-t1-sh-beats-ntxent-vsepp"]["verdict"] == INCONCLUSIVE
    assert found["ecir-t1-ntxent-beats-triplet-vsepp"]["verdict"] == REPRODUCED
    assert found["ecir-t2-triplet-counts-more-i2t-vsepp"]["verdict"] == REPRODUCED
    assert found["ecir-t2-sh-cq-is-one-vsepp"]["verdict"] == NOT_TESTABLE  # true by definition
    assert found["ecir-t4-smoothap-t2i-idle-vsepp"]["verdict"] == NOT_TESTABLE  # the seed code's bug
    assert found["ces-t1-ces-calibrates-vsepp"]["verdict"] == INVERTED
    assert found["ltd-t1-constraint-beats-baseline-vsepp"]["verdict"] == REPRODUCED
    assert found["ltd-t1-ltd-beats-itd-vsepp"]["verdict"] == NOT_RUN
    # 5 seeds against 3 (different seed sets): Welch, and 3 seeds decide only beyond every spread
    goal = found["goal-t5-cir-sigms-beats-con-con-i2t-gpo"]
    assert goal["test"]["name"] == "Welch t" and goal["verdict"] == REPRODUCED
    assert found["ecir-t1-sh-beats-triplet-gpo"]["verdict"] == NOT_RUN
    evidence = sh_triplet["evidence"]
    assert [[n["mean"] for n in group] for group in evidence] == [[353.8, 309.4], [298.8, 240.0]]
    counts = data["summary"]["all"]
    assert sum(counts.values()) == len(FINDINGS) and set(counts) == set(VERDICTS)
    assert counts[REPRODUCED] >= 5 and counts[INVERTED] >= 1 and counts[NOT_TESTABLE] >= 3
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
        assert after[2] == "| finding | paper's numbers | ours | test | verdict |"
    rows = [line for line in md.splitlines() if re.match(r"\| \*\*[a-z0-9]+-", line)]
    assert len(rows) == len(FINDINGS)
    assert all(line.count(" | ") == 4 for line in rows)  # no stray pipe in a cell
    assert "paired t: 50.00 [49.25, 50.75], df 4.0, p < 0.001" in md and "over batches ± " in md
    # the summary counts testable findings only
    testable = sum(counts[v] for v in TESTABLE)
    all_row = next(line for line in md.splitlines() if line.startswith("| **all** |"))
    assert all_row.split(" | ")[len(TESTABLE) + 1] == str(testable)
    assert md.rstrip().endswith("## What differs in the regime\n\nSynthetic images, 2 epochs.")


def test_regime_line_says_what_epochs_zero_means() -> None:
    """The reruns train each config's own epochs (epochs 0); the regime line says so."""
    reports = synthetic_reports()
    reports["vsepp"] = {**reports["vsepp"], "regime": {"epochs": 0, "batch_size": 128}}
    _, md = build_findings(reports)
    assert "Regime (vsepp): epochs `0` (the base config's own), batch_size `128`." in md
    assert "Regime (gpo): epochs `30`, batch_size `128`." in md


def test_build_findings_without_reports_does_not_crash() -> None:
    data, md = build_findings({})
    untestable = {f.id for f in FINDINGS if f.untestable}
    assert {f["id"] for f in data["findings"] if f["verdict"] == NOT_TESTABLE} == untestable
    assert {f["verdict"] for f in data["findings"] if f["id"] not in untestable} == {NOT_RUN}
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


def test_regime_differences_are_read_from_the_runs() -> None:
    """Early stops counted against each variant's own learning-rate step (+ 5, within the cap), LTD's
    temperature and Cross-Example Softmax's steps read from the report, SmoothAP's unscaled step."""
    from icr.training.analysis.regime_differences import differences, early_stops

    regime = {
        "data": "/nowhere/features",
        "base_config": "synthetic-paper-vsepp",
        "epochs": 20,
        "batch_size": 128,
        "smoothap_epoch_factor": 5,
        "overrides": ["train.threads=1"],
        "distractors": 0,
        "cocos_batches": 20,
        "patience": 2,
    }

    def entry(
        epochs: list[int], stopped: list[bool], params: dict[str, Any], best: list[int]
    ) -> dict[str, Any]:
        return {
            "runs": len(epochs),
            "seeds": list(range(len(epochs))),
            "objective": {"name": "x", "params": params},
            "per_seed": {
                "convergence": {
                    "epochs_completed": epochs,
                    "stopped_by_patience": stopped,
                    "best_epoch": best,
                    "best_step": [390 * b for b in best],
                }
            },
        }

    report = {
        "regime": regime,
        "variants": {
            # lr step at 15: due by epoch 20 (the cap); 12 and 18 stopped early, 20 did not
            "ntxent": entry(
                [12, 18, 20], [True, True, False], {"mask_duplicates": True, "temperature": 0.1}, [10, 16, 20]
            ),
            # SmoothAP: step at 15 of its 100 epochs, due by 20; 33 is not early, 19 is
            "smoothap": entry([33, 19], [True, True], {"mask_duplicates": True}, [31, 17]),
            "ntxent+ltd:constraint": entry([20, 20], [False, False], {"temperature": 0.1}, [20, 19]),
            "cross_example_softmax": entry([10, 16], [True, True], {"mask_duplicates": True}, [8, 14]),
        },
    }
    stopped, total, which = early_stops(report)
    assert (stopped, total) == (5, 9)  # ntxent 12, 18; smoothap 19; cross_example_softmax 10, 16
    assert which["ntxent"] == "2/3 at epochs 12, 18" and which["smoothap"] == "1/2 at epochs 19"
    assert which["cross_example_softmax"] == "2/2 at epochs 10, 16" and "ntxent+ltd:constraint" not in which
    rows = {r.setting: r for r in differences({"vsepp": report})}
    assert "5 of 9 runs stopped before their learning-rate step + 5 epochs" in rows["stopping (vsepp)"].ours
    assert "τ 0.1; uni-GRU (128)" in rows["`ntxent+ltd:constraint`"].ours
    assert "not scaled" in rows["SmoothAP schedule (vsepp)"].ours
    # steps: best step / best epoch x epochs = 390 x epochs; mean of 10 and 16 epochs
    assert "about 5.1k steps" in rows["`cross_example_softmax`"].ours
    assert "`mask_duplicates` on in 3 of 4 variants" in rows["false negatives (vsepp)"].ours
    assert differences({}) == []
    held = {**report, "regime": {**regime, "epochs": 0, "hold": 5, "scale_schedule": True}}
    stopping = next(r for r in differences({"vsepp": held}) if r.setting == "stopping (vsepp)")
    assert "a cap of 30 epochs" in stopping.ours
    assert "never before the learning-rate step + 5:" in stopping.ours


def test_the_papers_stopping_rule_in_the_run_configs() -> None:
    """No early stop before the learning-rate step + hold (SmoothAP: its scaled step and hold), each
    config's own epochs with --epochs 0, and regimes without the new fields keep their old keys."""
    from icr.training.analysis.compare import Regime, Variant, run_config

    regime = Regime(
        data="/nowhere",
        base_config="synthetic-paper-vsepp",
        epochs=0,
        patience=5,
        hold=5,
        scale_schedule=True,
    )
    ntxent = run_config(regime, Variant.parse("ntxent"), 0, Path("out"))
    assert (ntxent.train.epochs, ntxent.optim.lr_update, ntxent.train.min_epochs) == (30, 15, 20)
    smoothap = run_config(regime, Variant.parse("smoothap"), 0, Path("out"))
    assert (smoothap.train.epochs, smoothap.optim.lr_update, smoothap.train.min_epochs) == (150, 75, 100)
    assert smoothap.train.patience == 25  # 5 caption-level epochs of steps
    moved = Regime(
        data="/nowhere",
        base_config="synthetic-paper-vsepp",
        epochs=20,
        hold=5,
        overrides=("optim.lr_update=18",),
    )
    assert (
        run_config(moved, Variant.parse("ntxent"), 0, Path("out")).train.min_epochs == 20
    )  # 18 + 5, capped at 20
    old = Regime(data="/nowhere", base_config="synthetic-paper-vsepp", epochs=20)
    plain = run_config(old, Variant.parse("smoothap"), 0, Path("out"))
    assert (plain.optim.lr_update, plain.train.min_epochs) == (15, 0)
    # the committed runs' regime still has the key they were trained under
    result = json.loads(
        (
            Path(__file__).resolve().parents[1] / "docs/paper-regime/runs/gpo/triplet/seed0/result.json"
        ).read_text()
    )
    report = json.loads(
        (Path(__file__).resolve().parents[1] / "docs/paper-regime/gpo/report.json").read_text()
    )
    fields = {**report["regime"], "overrides": tuple(report["regime"]["overrides"])}
    assert Regime(**fields).key() == result["regime_key"]


RERUNS = Path(__file__).resolve().parents[1] / "docs/paper-regime/rerun"


def _rerun_suite() -> Any:
    """The suite of the command the committed findings quote: the defaults plus train.threads=1 on
    /work/exp/features."""
    from icr.training.analysis.paper_regime import PaperSuite

    return PaperSuite(Path("/work/exp/features"), overrides=("train.threads=1",))


def test_committed_reruns_are_in_the_default_stopping_rule_regime() -> None:
    """The reruns' findings are rebuilt by the command docs/evaluation.md quotes (the defaults plus
    train.threads=1 on /work/exp/features): every committed rerun carries that regime's key, and no
    run ended before its learning-rate step + hold epochs."""
    from icr.training.analysis.compare import Variant, run_config

    suite = _rerun_suite()
    results = sorted((RERUNS / "runs").glob("*/*/seed*/result.json"))
    assert results
    for path in results:
        encoder = path.parts[-4]
        result = json.loads(path.read_text())
        regime = suite.regime(encoder)
        assert result["regime_key"] == regime.key(), path
        config = run_config(regime, Variant.parse(result["variant"]), result["seed"], Path("out"))
        assert config.train.min_epochs >= 20 and result["epochs_completed"] >= config.train.min_epochs, path


def test_committed_findings_are_rebuilt_from_the_committed_reruns(tmp_path: Path) -> None:
    """docs/paper-findings.md and its JSON follow from the committed reruns by the command they quote:
    rebuilding them from docs/paper-regime/rerun/runs (finished runs only, nothing trained) gives the
    committed JSON and the committed reports, number for number."""
    from icr.training.analysis.paper_regime import SUITES, run_paper_suite

    root = Path(__file__).resolve().parents[1]
    command = (
        "icr analyze paper --report-only --runs docs/paper-regime/rerun/runs --docs docs/paper-regime/rerun "
        "--set train.threads=1 --features /work/exp/features --quiet"
    )
    committed = json.loads((root / "docs/paper-findings.json").read_text())
    assert set(committed["commands"].values()) == {command}
    rebuilt = run_paper_suite(
        _rerun_suite(),
        list(SUITES),
        RERUNS / "runs",
        tmp_path / "docs",
        tmp_path / "paper-findings.md",
        command=command,
        progress=False,
        log=lambda _: None,
        finished_only=True,
    )
    assert json.loads(json.dumps(rebuilt)) == committed
    assert (tmp_path / "paper-findings.md").read_text() == (root / "docs/paper-findings.md").read_text()
    for encoder in SUITES:
        report = json.loads((tmp_path / "docs" / encoder / "report.json").read_text())
        assert report == json.loads((RERUNS / encoder / "report.json").read_text())
