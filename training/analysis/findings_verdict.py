"""The verdict rule of the papers' findings: the ``Finding`` record, the verdicts, and how one finding
is judged on our loss comparisons.

A :class:`Finding` is one qualitative claim of a paper that two (or more) of our variants can test on
one metric of an ``icr analyze compare`` report: which paper and table, the claim, the paper's numbers
behind it (keys of :data:`icr.training.analysis.paper_numbers.NUMBERS`), our encoder (``"vsepp"`` or
``"gpo"``), the variants, the metric path(s) inside a variant entry (e.g. ``annotations/rsum``,
``calibration/PR-AUC (annotations)``, ``cocos/i2t_Cq``) and the kind of claim. The findings themselves
are in :mod:`icr.training.analysis.findings_catalogue`; the report that shows their verdicts is
:mod:`icr.training.analysis.findings_report`.

The unit of evidence is one training seed: a variant entry's ``per_seed`` values (one per seed in
``seeds``; for COCOS counts each seed's mean over its training batches) are what the tests of
:mod:`icr.training.analysis.significance` compare. The rule itself is :data:`VERDICT_RULE`, repeated
in the generated markdown. A variant, metric or report that is absent (or null) gives **not run**;
nothing raises.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from icr.training.analysis.significance import TTest, one_sample, paired, welch

ENCODERS = ("vsepp", "gpo")
ALPHA = 0.05  # every test's level
MIN_SEEDS = 5  # seeds per side below which a significant test alone decides nothing
EQUIVALENCE = 0.02  # default equivalence bound: 2 % of the larger side's mean (a finding may state its own)
COLLAPSE = 0.25  # a variant whose rsum is below this share of its encoder's median variant collapsed

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
INVERTED = "inverted"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable"
NOT_RUN = "not run"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INVERTED, INCONCLUSIVE, NOT_TESTABLE, NOT_RUN)
TESTABLE = (REPRODUCED, NOT_REPRODUCED, INVERTED, INCONCLUSIVE)  # what the summary counts

GREATER, AT_LEAST, SIMILAR = "greater", "at_least", "similar"
EQUALS, ABOVE, BELOW = "equals", "above", "below"
ANTI_RANKED = "anti_ranked"
BEST_ALSO = "best_also"
PAIRWISE = (GREATER, AT_LEAST, SIMILAR)
SINGLE = (EQUALS, ABOVE, BELOW)
KINDS = (*PAIRWISE, *SINGLE, ANTI_RANKED, BEST_ALSO)

VERDICT_RULE = f"""\
One training seed is one observation. Two variants trained with the same seeds are compared by a
**paired t test** over seeds (the same seed gives both the same initialisation and data order);
otherwise, or for different seed sets, by **Welch's t test**; a single quantity against a stated
target by a **one-sample t test**. Standard deviations are sample ones (ddof = 1), p-values come from
the t distribution, every test is at level α = {ALPHA}. COCOS counts enter as each seed's mean over
its training batches; their spread over batches is shown, labelled, but not tested.

* **A > B**: *reproduced* if the one-sided test of A − B > 0 gives p < α; *inverted* if the one-sided
  test of A − B < 0 does; *not reproduced* if the two one-sided tests (TOST) show A − B within the
  equivalence bound δ; otherwise *inconclusive*.
* **A ≥ B** ("B does not outperform A"): *reproduced* if A − B > −δ (one-sided, p < α); *inverted* if
  A − B < −δ; otherwise *inconclusive*.
* **A ≈ B**: *reproduced* if TOST shows |A − B| < δ; *not reproduced* if A − B is shown beyond ±δ;
  otherwise *inconclusive*.
* **single quantity x**: x = target is judged as A ≈ B with the finding's tolerance as δ; x > target
  (x < target) as A > B against the target.
* **more contributing samples ⇒ lower score** (anti-ranked): a pair of variants is decided when both its
  count difference and its score difference are significant (two-sided, p < α); it is concordant if
  they have opposite signs. *Reproduced* if some pair is concordant and none discordant, *inverted* if
  the reverse, *not reproduced* if both occur, *inconclusive* if no pair is decided.
* **the best on one metric is also the best on another** (best-also): the variant with the highest
  mean on the first metric is tested as A ≥ B against every other variant on the second; *reproduced*
  if every test reproduces, *inverted* if any inverts, otherwise *inconclusive*.
* δ is the finding's stated bound, else {EQUIVALENCE:.0%} of the larger of the two means.
* **Fewer than {MIN_SEEDS} seeds on a side**: a significant test decides only if the effect (the distance
  of the estimate from the null's boundary) is larger than every seed's spread combined (the sum of each
  side's max − min over seeds); otherwise the verdict is *inconclusive*, and the row says which.
  Fewer than 2 seeds on a side: no test, *inconclusive*.
* **Not testable** (left out of the summary): a claim true by definition of the counter, a paper value
  that is an artefact of the seed code, or a comparison with a variant that collapsed (its rsum below
  {COLLAPSE:.0%} of the median variant's on that encoder: it trained to nothing, so no loss property
  can be read from it).
* A variant, metric or report that is absent, or a null value, gives *not run*."""


@dataclass(frozen=True)
class Finding:
    """One claim of a paper, tested on one encoder (semantics of ``kind``: :data:`VERDICT_RULE`).

    ``variants``: (A, B) for pairwise kinds (the claim expects A > B, A >= B or A ~ B), one variant
    for single quantities, two or more for ``anti_ranked``. ``metrics``: one path shared by all
    variants, or one per variant (pairwise kinds); for ``anti_ranked`` (count metric, score metric).
    ``evidence``: groups of paper-number keys, one group per paper setting (dataset, method), in
    variant order for pairwise kinds. ``bound``: the equivalence bound of ``similar`` / ``at_least``
    (default :data:`EQUIVALENCE` of the larger mean); ``tolerance`` that of ``equals``.
    ``untestable``: why no run can test the claim (it is then *not testable*).
    """

    id: str
    paper: str
    table: str
    claim: str
    encoder: str
    kind: str
    variants: tuple[str, ...]
    metrics: tuple[str, ...]
    evidence: tuple[tuple[str, ...], ...]
    target: float | None = None
    tolerance: float | None = None
    note: str = ""
    bound: float | None = None
    untestable: str = ""

    def paper_keys(self) -> tuple[str, ...]:
        return tuple(k for group in self.evidence for k in group)

    def metric_of(self, index: int) -> str:
        return self.metrics[0] if len(self.metrics) == 1 else self.metrics[index]


@dataclass(frozen=True)
class Outcome:
    verdict: str
    p: float | None  # the p-value behind the verdict (for inconclusive: the claim's own test)
    detail: str
    ours: tuple[dict[str, Any], ...]  # {"variant", "metric", "mean", "std", "runs", "batch_std"} per side
    test: dict[str, Any] | None = None  # name, estimate, interval, df, n of the test


# --- per-seed values ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Side:
    """One variant's values of one metric, by seed."""

    variant: str
    metric: str
    values: dict[int, float]

    def spread(self) -> float:
        return max(self.values.values()) - min(self.values.values())


def _path(node: Any, path: str) -> tuple[Any, bool]:
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None, False
        node = node[part]
    return node, True


def as_mean_std(node: Any) -> tuple[float, float] | None:
    """(mean, std) of a report value (``[mean, std]``, or a bare number with std 0); None for a
    null, a boolean, any other shape or a non-finite value."""
    if isinstance(node, bool):
        return None
    if isinstance(node, int | float):
        pair: tuple[Any, Any] = (node, 0.0)
    elif isinstance(node, list | tuple) and len(node) == 2:
        pair = (node[0], node[1])
    else:
        return None
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in pair):
        return None
    mean, std = float(pair[0]), float(pair[1])
    return (mean, std) if math.isfinite(mean) and math.isfinite(std) else None


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def lookup(
    reports: Mapping[str, Mapping[str, Any]], encoder: str, variant: str, metric: str
) -> tuple[Side | None, str]:
    """(the per-seed values of ``metric`` (a ``/`` path) for one variant of one report, or None, why)."""
    report = reports.get(encoder)
    if not isinstance(report, Mapping):
        return None, f"no {encoder} report"
    entry = (report.get("variants") or {}).get(variant)
    if not isinstance(entry, Mapping):
        return None, f"{variant} not in the {encoder} report"
    seeds = entry.get("seeds")
    if not isinstance(entry.get("per_seed"), Mapping) or not isinstance(seeds, list):
        return None, f"{variant}: the {encoder} report has no per-seed values (rebuild it with --report-only)"
    node, found = _path(entry["per_seed"], metric)
    if not found:
        return None, f"{variant}: no {metric}"
    if node is None:
        return None, f"{variant}: {metric} is null"
    if not isinstance(node, list) or len(node) != len(seeds):
        return None, f"{variant}: {metric} has no value per seed"
    values = {int(s): float(v) for s, v in zip(seeds, node, strict=True) if _finite(v)}
    return (Side(variant, metric, values), "") if values else (None, f"{variant}: {metric} is null")


def _ours(side: Side, entry_value: Any, runs: Any) -> dict[str, Any]:
    xs = list(side.values.values())
    batch = entry_value if side.metric.startswith("cocos/") else None
    return {
        "variant": side.variant,
        "metric": side.metric,
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) > 1 else None,  # over seeds, ddof = 1
        "runs": len(xs) if runs is None else runs,
        # COCOS: the report's std over the training batches of all seeds, a different spread
        "batch_std": batch[1] if isinstance(batch, list | tuple) and len(batch) == 2 else None,
    }


def _absent(variant: str, metric: str) -> dict[str, Any]:
    return {"variant": variant, "metric": metric, "mean": None, "std": None, "runs": None, "batch_std": None}


# --- the rule --------------------------------------------------------------------------------------
def compare_sides(a: Side, b: Side) -> TTest:
    """Paired over the seeds both sides have when their seed sets are equal, Welch otherwise."""
    if set(a.values) == set(b.values):
        seeds = sorted(a.values)
        return paired([a.values[s] for s in seeds], [b.values[s] for s in seeds])
    return welch(list(a.values.values()), list(b.values.values()))


def _callable(p: float, distance: float, spread: float, n_min: int) -> tuple[bool, str]:
    """Whether a test with p-value ``p`` may decide: p < ALPHA, and either MIN_SEEDS seeds per side
    or an effect (``distance`` beyond the null's boundary) above the seeds' combined ``spread``."""
    if p >= ALPHA:
        return False, ""
    if n_min >= MIN_SEEDS:
        return True, ""
    if distance > spread:
        return True, (
            f"{n_min} seeds, decided because the effect {distance:.3g} exceeds every seed's spread "
            f"combined ({spread:.3g})"
        )
    return False, (
        f"p = {p:.2g} < {ALPHA}, but {n_min} seeds on a side and the effect {distance:.3g} lies within "
        f"the seeds' combined spread ({spread:.3g})"
    )


def _held_back(verdict: str, note: str) -> str:
    return f"{verdict} held back: {note}" if note else ""


def judge(kind: str, test: TTest, bound: float, spread: float) -> tuple[str, float, str]:
    """(verdict, p, why) of a pairwise or single-quantity claim from its test (see VERDICT_RULE)."""
    d, n_min = test.estimate, min(test.n)
    if kind in (GREATER, ABOVE, BELOW):
        sign = -1.0 if kind == BELOW else 1.0
        p_claim = test.p_greater() if sign > 0 else test.p_less()
        p_against = test.p_less() if sign > 0 else test.p_greater()
        options = [
            (REPRODUCED, p_claim, sign * d),
            (INVERTED, p_against, -sign * d),
            (NOT_REPRODUCED, test.p_equivalent(bound), bound - abs(d)),
        ]
    elif kind == AT_LEAST:
        p_claim = test.p_greater(-bound)
        options = [(REPRODUCED, p_claim, d + bound), (INVERTED, test.p_less(-bound), -(d + bound))]
    elif kind in (SIMILAR, EQUALS):
        p_claim = test.p_equivalent(bound)
        p_beyond = min(test.p_greater(bound), test.p_less(-bound))
        options = [(REPRODUCED, p_claim, bound - abs(d)), (NOT_REPRODUCED, p_beyond, abs(d) - bound)]
    else:
        raise ValueError(f"not a pairwise or single-quantity kind: {kind!r}")
    why = ""
    for verdict, p, distance in options:
        ok, note = _callable(p, distance, spread, n_min)
        if ok:
            return verdict, p, note
        why = why or _held_back(verdict, note)
    return INCONCLUSIVE, p_claim, why


def anti_ranked_verdict(pairs: Sequence[tuple[int, int]]) -> tuple[str, int, int]:
    """(verdict, concordant, discordant) from the decided signs (count, score) of every variant pair
    (0 where that difference is not decided)."""
    decided = [(sx, sy) for sx, sy in pairs if sx and sy]
    concordant = sum(1 for sx, sy in decided if sx != sy)
    discordant = len(decided) - concordant
    if concordant and discordant:
        return NOT_REPRODUCED, concordant, discordant
    if concordant:
        return REPRODUCED, concordant, discordant
    if discordant:
        return INVERTED, concordant, discordant
    return INCONCLUSIVE, 0, 0


def _decided_sign(a: Side, b: Side) -> int:
    """+1 / -1 where A - B differs from 0 (two-sided, callable under the seed rule), else 0."""
    if min(len(a.values), len(b.values)) < 2:
        return 0
    test = compare_sides(a, b)
    ok, _ = _callable(test.p_two_sided(), abs(test.estimate), a.spread() + b.spread(), min(test.n))
    return (1 if test.estimate > 0 else -1) if ok else 0


def collapsed(reports: Mapping[str, Mapping[str, Any]], encoder: str, variant: str) -> str:
    """Why ``variant`` collapsed on ``encoder`` (its annotations rsum below COLLAPSE of the median
    variant's), or "" if it did not or cannot be told."""
    report = reports.get(encoder)
    entries = (report.get("variants") or {}) if isinstance(report, Mapping) else {}
    rsums = {
        name: value[0]
        for name, entry in entries.items()
        if (value := as_mean_std(_path(entry, "annotations/rsum")[0])) is not None
    }
    if variant not in rsums or len(rsums) < 3:
        return ""
    median = statistics.median(rsums.values())
    if rsums[variant] >= COLLAPSE * median:
        return ""
    return (
        f"{variant} collapsed on {encoder} (rsum {rsums[variant]:.1f}, below {COLLAPSE:.0%} of the median "
        f"variant's {median:.1f}): no loss property can be read from it"
    )


def _bound(a: Side, b: Side, stated: float | None) -> float:
    if stated is not None:
        return stated
    return EQUIVALENCE * max(
        abs(statistics.fmean(a.values.values())), abs(statistics.fmean(b.values.values()))
    )


def _best_also(
    finding: Finding, sides: Mapping[tuple[str, str], Side], ours: tuple[dict[str, Any], ...]
) -> Outcome:
    """The variant best on the first metric, tested A >= B on the second against every other variant."""
    first, second = finding.metrics
    best = max(finding.variants, key=lambda v: statistics.fmean(sides[(v, first)].values.values()))
    verdicts, notes = [], []
    for other in (v for v in finding.variants if v != best):
        a, b = sides[(best, second)], sides[(other, second)]
        if min(len(a.values), len(b.values)) < 2:
            verdicts.append(INCONCLUSIVE)
            notes.append(f"{other}: fewer than 2 seeds")
            continue
        test = compare_sides(a, b)
        verdict, p, _ = judge(AT_LEAST, test, _bound(a, b, finding.bound), a.spread() + b.spread())
        verdicts.append(verdict)
        notes.append(f"{other}: {verdict} (p {p:.2g})")
    verdict = (
        INVERTED if INVERTED in verdicts else REPRODUCED if set(verdicts) == {REPRODUCED} else INCONCLUSIVE
    )
    return Outcome(verdict, None, f"best on {first}: {best}; on {second} against " + "; ".join(notes), ours)


def _test_json(test: TTest) -> dict[str, Any]:
    return {
        "name": test.name,
        "estimate": test.estimate,
        # 90 %: the interval that matches one-sided tests (and TOST) at level 0.05
        "interval_90": list(test.interval(0.90)),
        "df": test.df,
        "n": list(test.n),
    }


def evaluate(finding: Finding, reports: Mapping[str, Mapping[str, Any]]) -> Outcome:
    """The verdict of one finding on the reports ({"vsepp": report, "gpo": report}, either may be absent)."""
    if finding.kind in (ANTI_RANKED, BEST_ALSO):
        specs = [(v, m) for v in finding.variants for m in finding.metrics]
    else:
        specs = [(v, finding.metric_of(i)) for i, v in enumerate(finding.variants)]
    sides: dict[tuple[str, str], Side] = {}
    reasons: list[str] = []
    ours = []
    entries = ((reports.get(finding.encoder) or {}).get("variants") or {}) if reports else {}
    for variant, metric in specs:
        side, why = lookup(reports, finding.encoder, variant, metric)
        if side is None:
            reasons.append(why)
            ours.append(_absent(variant, metric))
            continue
        entry = entries.get(variant, {})
        ours.append(_ours(side, _path(entry, metric)[0], entry.get("runs")))
        sides[(variant, metric)] = side
    if finding.untestable:
        return Outcome(NOT_TESTABLE, None, finding.untestable, tuple(ours))
    if reasons:
        return Outcome(NOT_RUN, None, "; ".join(dict.fromkeys(reasons)), tuple(ours))
    if why := "; ".join(filter(None, (collapsed(reports, finding.encoder, v) for v in finding.variants))):
        return Outcome(NOT_TESTABLE, None, why, tuple(ours))
    if finding.kind == ANTI_RANKED:
        count, score = finding.metrics
        pairs = [
            (
                _decided_sign(sides[(a, count)], sides[(b, count)]),
                _decided_sign(sides[(a, score)], sides[(b, score)]),
            )
            for a, b in itertools.combinations(finding.variants, 2)
        ]
        verdict, concordant, discordant = anti_ranked_verdict(pairs)
        detail = f"{concordant} concordant, {discordant} discordant of {len(pairs)} pairs"
        return Outcome(verdict, None, detail, tuple(ours))
    if finding.kind == BEST_ALSO:
        return _best_also(finding, sides, tuple(ours))
    chosen = [sides[s] for s in specs]
    if min(len(s.values) for s in chosen) < 2:
        means = [o["mean"] for o in ours]
        shown = f"difference {means[0] - means[1]:+.4g}" if len(means) == 2 else f"value {means[0]:.4g}"
        return Outcome(INCONCLUSIVE, None, f"fewer than 2 seeds on a side: no test ({shown})", tuple(ours))
    if finding.kind in PAIRWISE:
        a, b = chosen
        test = compare_sides(a, b)
        bound = _bound(a, b, finding.bound)
        spread = a.spread() + b.spread()
    elif finding.kind in SINGLE:
        if finding.target is None or (finding.kind == EQUALS and finding.tolerance is None):
            raise ValueError(
                f"finding {finding.id}: a single-quantity claim needs a target (and = a tolerance)"
            )
        (x,) = chosen
        test = one_sample(list(x.values.values()), finding.target)
        bound = finding.tolerance if finding.tolerance is not None else 0.0
        spread = x.spread()
    else:
        raise ValueError(f"finding {finding.id}: unknown kind {finding.kind!r}")
    verdict, p, why = judge(finding.kind, test, bound, spread)
    detail = "; ".join(filter(None, (f"δ {bound:.3g}", why)))
    return Outcome(verdict, p, detail, tuple(ours), _test_json(test))


__all__ = [
    "VERDICTS",
    "VERDICT_RULE",
    "Finding",
    "Outcome",
    "as_mean_std",
    "compare_sides",
    "evaluate",
    "judge",
    "lookup",
]
