"""The verdict rule of the papers' findings: the ``Finding`` record, the verdicts, and how one finding
is judged on our loss comparisons.

A :class:`Finding` is one qualitative claim of a paper that two (or more) of our variants can test on
one metric of an ``icr analyze compare`` report (``report["variants"][variant]``, values
``[mean, std]`` over seeds): which paper and table, the claim, the paper's numbers behind it (keys of
:data:`icr.training.analysis.paper_numbers.NUMBERS`), our encoder (``"vsepp"`` or ``"gpo"``), the
variants, the metric path(s) inside a variant entry (e.g. ``annotations/rsum``,
``calibration/PR-AUC (annotations)``, ``cocos/i2t_Cq``) and the kind of claim. The findings themselves
are in :mod:`icr.training.analysis.findings_catalogue`; the report that shows their verdicts is
:mod:`icr.training.analysis.findings_report`.

Verdict rule (:data:`VERDICT_RULE`, repeated in the generated markdown)
----------------------------------------------------------------------
For a pairwise claim "A > B on metric m": ``d = mean_A - mean_B``,
``s = sqrt((std_A^2 + std_B^2) / 2)`` (the stds in the report: over seeds for retrieval and
calibration metrics; over training batches of all seeds for COCOS counts, as ``compare`` pools them),
floored at ``1e-9``; ``margin = d / s``, capped at +-1000 (a cap means a difference with zero std).

* ``greater`` (A > B): **reproduced** if margin >= 1, **inverted** if margin <= -1, otherwise
  **not reproduced (within noise)**;
* ``at_least`` (A is not below B, e.g. "SmoothAP does not outperform Triplet SH" as SH >= SmoothAP):
  reproduced if margin > -1, inverted if margin <= -1;
* ``similar`` (A ~ B): reproduced if |margin| < 1, otherwise **not reproduced (differs)**;
* single quantities, with an explicit tolerance ``tol`` given in the finding: ``equals`` (x = target):
  reproduced if |mean - target| <= tol, otherwise not reproduced (differs); ``above`` (x > target):
  reproduced if mean >= target + tol, inverted if mean <= target - tol, otherwise within noise
  (``below`` mirrored);
* ``anti_ranked`` (variants that count more contributing samples score lower): every pair of the
  variants whose margins on both the count and the score are at least 1 in size is concordant
  (opposite signs) or discordant (same sign); reproduced if some pair is concordant and none
  discordant, inverted if the reverse, **not reproduced (mixed)** if both occur, within noise if no
  pair is decided.

A variant, metric or encoder report that is absent (or a null / non-finite value) gives **not run**;
nothing raises.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENCODERS = ("vsepp", "gpo")
STD_FLOOR = 1e-9
MARGIN_CAP = 1000.0

REPRODUCED = "reproduced"
WITHIN_NOISE = "not reproduced (within noise)"
DIFFERS = "not reproduced (differs)"
MIXED = "not reproduced (mixed)"
INVERTED = "inverted"
NOT_RUN = "not run"
ONE_SEED = "not decided (one seed)"
VERDICTS = (REPRODUCED, WITHIN_NOISE, DIFFERS, MIXED, INVERTED, ONE_SEED, NOT_RUN)

GREATER, AT_LEAST, SIMILAR = "greater", "at_least", "similar"
EQUALS, ABOVE, BELOW = "equals", "above", "below"
ANTI_RANKED = "anti_ranked"
PAIRWISE = (GREATER, AT_LEAST, SIMILAR)
SINGLE = (EQUALS, ABOVE, BELOW)
KINDS = (*PAIRWISE, *SINGLE, ANTI_RANKED)

VERDICT_RULE = """\
For a claim "A > B on metric m": d = mean_A − mean_B and s = sqrt((std_A² + std_B²) / 2), with the
stds of the reports (over seeds for retrieval and calibration metrics; over the training batches of
all seeds for COCOS counts, as `icr analyze compare` pools them), floored at 1e-9; the margin d / s
is in those standard deviations (capped at ±1000, which means a difference with zero std).

* **A > B**: *reproduced* if margin ≥ 1, *inverted* if margin ≤ −1, otherwise *not reproduced
  (within noise)*.
* **A ≥ B** ("A is not outperformed by B"): *reproduced* if margin > −1, *inverted* if margin ≤ −1.
* **A ≈ B**: *reproduced* if |margin| < 1, otherwise *not reproduced (differs)*.
* **single quantity x** with the tolerance tol stated in the finding: x = target is *reproduced* if
  |x − target| ≤ tol (else *differs*); x > target is *reproduced* if x ≥ target + tol, *inverted* if
  x ≤ target − tol, otherwise *within noise* (x < target mirrored). The margin shown is
  (x − target) / std.
* **more contributing samples ⇒ lower score** (anti-ranked): each pair of the variants whose margins
  on the count and on the score are both ≥ 1 in size is concordant (opposite signs) or discordant
  (same sign); *reproduced* if some pair is concordant and none discordant, *inverted* if the reverse,
  *not reproduced (mixed)* if both occur, *within noise* if no pair is decided.
* A comparison of two sides that both have a zero std because each was run with one seed has no
  noise estimate: *not decided (one seed)* (the difference is still shown).
* A variant, metric or report that is absent, or a null value, gives *not run*.

The paper's own margin (same formula with the paper's stds, where it prints them) is shown next to
its numbers; for papers without stds only the difference is shown."""


@dataclass(frozen=True)
class Finding:
    """One claim of a paper, tested on one encoder (semantics of ``kind``: module docstring).

    ``variants``: (A, B) for pairwise kinds (the claim expects A > B, A >= B or A ~ B), one variant
    for single quantities, two or more for ``anti_ranked``. ``metrics``: one path shared by all
    variants, or one per variant (pairwise kinds); for ``anti_ranked`` (count metric, score metric).
    ``evidence``: groups of paper-number keys, one group per paper setting (dataset, method), in
    variant order for pairwise kinds.
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

    def paper_keys(self) -> tuple[str, ...]:
        return tuple(k for group in self.evidence for k in group)

    def metric_of(self, index: int) -> str:
        return self.metrics[0] if len(self.metrics) == 1 else self.metrics[index]


@dataclass(frozen=True)
class Outcome:
    verdict: str
    margin: float | None
    detail: str
    ours: tuple[dict[str, Any], ...]  # {"variant", "metric", "mean", "std", "runs"} per side


# --- verdict rule -----------------------------------------------------------------------------------
def _margin(difference: float, std: float) -> float:
    """``difference / std`` in stds, std floored at STD_FLOOR, the result capped at +-MARGIN_CAP."""
    return max(-MARGIN_CAP, min(MARGIN_CAP, difference / max(std, STD_FLOOR)))


def pairwise_margin(a: Sequence[float], b: Sequence[float]) -> float:
    """(mean_A - mean_B) / sqrt((std_A^2 + std_B^2) / 2), std floored at STD_FLOOR, capped at MARGIN_CAP."""
    return _margin(a[0] - b[0], math.sqrt((a[1] ** 2 + b[1] ** 2) / 2))


def pairwise_verdict(kind: str, margin: float) -> str:
    if kind == GREATER:
        return REPRODUCED if margin >= 1 else INVERTED if margin <= -1 else WITHIN_NOISE
    if kind == AT_LEAST:
        return REPRODUCED if margin > -1 else INVERTED
    if kind == SIMILAR:
        return REPRODUCED if abs(margin) < 1 else DIFFERS
    raise ValueError(f"not a pairwise kind: {kind!r}")


def single_verdict(kind: str, mean: float, target: float, tolerance: float) -> str:
    if kind == EQUALS:
        return REPRODUCED if abs(mean - target) <= tolerance else DIFFERS
    if kind == ABOVE:
        return (
            REPRODUCED
            if mean >= target + tolerance
            else INVERTED
            if mean <= target - tolerance
            else WITHIN_NOISE
        )
    if kind == BELOW:
        return (
            REPRODUCED
            if mean <= target - tolerance
            else INVERTED
            if mean >= target + tolerance
            else WITHIN_NOISE
        )
    raise ValueError(f"not a single-quantity kind: {kind!r}")


def anti_ranked_verdict(pairs: Sequence[tuple[float, float]]) -> tuple[str, int, int]:
    """(verdict, concordant, discordant) from (count margin, score margin) of every variant pair."""
    decided = [(mx, my) for mx, my in pairs if abs(mx) >= 1 and abs(my) >= 1]
    concordant = sum(1 for mx, my in decided if (mx > 0) != (my > 0))
    discordant = len(decided) - concordant
    if concordant and discordant:
        return MIXED, concordant, discordant
    if concordant:
        return REPRODUCED, concordant, discordant
    if discordant:
        return INVERTED, concordant, discordant
    return WITHIN_NOISE, 0, 0


# --- reading reports ---------------------------------------------------------------------------------
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


def lookup(
    reports: Mapping[str, Mapping[str, Any]], encoder: str, variant: str, metric: str
) -> tuple[tuple[float, float] | None, str]:
    """((mean, std) or None, why it is None) of ``metric`` (a ``/`` path) for one variant of one report."""
    report = reports.get(encoder)
    if not isinstance(report, Mapping):
        return None, f"no {encoder} report"
    entry = (report.get("variants") or {}).get(variant)
    if not isinstance(entry, Mapping):
        return None, f"{variant} not in the {encoder} report"
    node: Any = entry
    for part in metric.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None, f"{variant}: no {metric}"
        node = node[part]
    value = as_mean_std(node)
    return (value, "") if value is not None else (None, f"{variant}: {metric} is null")


def _runs(reports: Mapping[str, Mapping[str, Any]], encoder: str, variant: str) -> int | None:
    report = reports.get(encoder)
    entry = ((report or {}).get("variants") or {}).get(variant) if isinstance(report, Mapping) else None
    runs = entry.get("runs") if isinstance(entry, Mapping) else None
    return runs if isinstance(runs, int) else None


def evaluate(finding: Finding, reports: Mapping[str, Mapping[str, Any]]) -> Outcome:
    """The verdict of one finding on the reports ({"vsepp": report, "gpo": report}, either may be absent)."""
    if finding.kind == ANTI_RANKED:
        sides = [(v, m) for v in finding.variants for m in finding.metrics]
    else:
        sides = [(v, finding.metric_of(i)) for i, v in enumerate(finding.variants)]
    values: dict[tuple[str, str], tuple[float, float]] = {}
    reasons: list[str] = []
    ours = []
    for variant, metric in sides:
        value, why = lookup(reports, finding.encoder, variant, metric)
        ours.append(
            {
                "variant": variant,
                "metric": metric,
                "mean": None if value is None else value[0],
                "std": None if value is None else value[1],
                "runs": _runs(reports, finding.encoder, variant),
            }
        )
        if value is None:
            reasons.append(why)
        else:
            values[(variant, metric)] = value
    if reasons:
        return Outcome(NOT_RUN, None, "; ".join(dict.fromkeys(reasons)), tuple(ours))
    if finding.kind in PAIRWISE:
        a, b = (values[s] for s in sides)
        if a[1] == b[1] == 0 and all(int(o["runs"] or 0) < 2 for o in ours):
            return Outcome(ONE_SEED, None, f"difference {a[0] - b[0]:+.4g}", tuple(ours))
        margin = pairwise_margin(a, b)
        return Outcome(pairwise_verdict(finding.kind, margin), margin, "", tuple(ours))
    if finding.kind in SINGLE:
        if finding.target is None or finding.tolerance is None:
            raise ValueError(f"finding {finding.id}: a single-quantity claim needs target and tolerance")
        mean, std = values[sides[0]]
        margin = _margin(mean - finding.target, std)
        detail = f"target {finding.target:g}, tolerance {finding.tolerance:g}"
        return Outcome(
            single_verdict(finding.kind, mean, finding.target, finding.tolerance), margin, detail, tuple(ours)
        )
    if finding.kind == ANTI_RANKED:
        count, score = finding.metrics
        pairs = [
            (
                pairwise_margin(values[(a, count)], values[(b, count)]),
                pairwise_margin(values[(a, score)], values[(b, score)]),
            )
            for a, b in itertools.combinations(finding.variants, 2)
        ]
        verdict, concordant, discordant = anti_ranked_verdict(pairs)
        detail = f"{concordant} concordant, {discordant} discordant of {len(pairs)} pairs"
        return Outcome(verdict, None, detail, tuple(ours))
    raise ValueError(f"finding {finding.id}: unknown kind {finding.kind!r}")


__all__ = [
    "VERDICTS",
    "VERDICT_RULE",
    "Finding",
    "Outcome",
    "as_mean_std",
    "evaluate",
    "pairwise_margin",
]
