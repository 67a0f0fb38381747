"""Per-query honesty: does each query's promise match what it delivers?

Threshold honesty (:mod:`.threshold_honesty`) pools the hits of many queries; a user looks at one
query's results. For every held-out query, at the top ``k`` of its list:

* ``promised``: the mean relevance the service shows beside those hits. A query outside the
  calibration's evidence (:mod:`.query_evidence`) is shown no relevance and ``min_relevance``
  passes none of its hits: it promises 0;
* ``delivered``: the share of those hits the labels call relevant (on the embedded benchmark the
  generator's ground truth, for every hit, a caption's own image included).

Per group of queries (pooled, and per query kind where kinds are known): ``mae`` = mean
``|promised - delivered|``, ``over`` = share of queries with ``promised - delivered > slack``
(over-promised), ``under`` = share with ``delivered - promised > slack`` (under-promised: "three
shapes" shown 0.48 while all its top 20 are right is a defect too), ``withheld`` = share given no
promise, and the means of both.

A gap is not all miscalibration: a hit shown relevance 0.7 is relevant or not, so even a map whose
every value were exactly right would miss by chance. Where the hits of a query are independent, its
count of relevant hits in the top ``k`` is Poisson-binomial with the shown values as probabilities
(:func:`poisson_binomial`). Two figures read it (:func:`chance_figures`):

* ``chance_mae``: the mean ``|promised - delivered|`` that distribution gives, i.e. the MAE a map with
  these very values would still show if each were exactly right. A kind whose values sit near 0.5
  cannot reach a small MAE however honest: only sharper values (a model that tells its relevant hits
  from near misses) lower it;
* ``outside``: the share of queries whose delivered count is outside the central 95 % of that
  distribution (two-sided p < 0.05). About 5 % or fewer for an honest map with independent hits; more
  means the promise itself is off for those queries (or their hits fail together).

Out-of-domain queries (:func:`ood_figures`) have no labels: what matters is whether anything passes
a threshold, so per group the share of queries with at least one hit at relevance >= each target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

TOP_K = 20
SLACK = 0.2
OUTSIDE_P = 0.05  # a query is outside its promise's range when its two-sided p-value is below this
OOD_TARGETS: tuple[float, ...] = (0.5, 0.9)


def promised_delivered(
    relevant: np.ndarray, relevance: np.ndarray, k: int = TOP_K
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(promised, delivered, withheld), each (Q,), at the top ``k`` of (Q, depth) best-first lists.

    ``relevance`` rows of NaN are queries given no promise (promised 0, withheld True)."""
    relevance = np.asarray(relevance, dtype=np.float64)
    relevant = np.asarray(relevant, dtype=bool)
    if relevance.shape != relevant.shape or relevance.ndim != 2:
        raise ValueError(
            f"relevance {relevance.shape} and relevant {relevant.shape} must be the same (Q, depth)"
        )
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    top = relevance[:, :k]  # (Q, k')
    withheld = np.isnan(top).all(axis=1)  # (Q,)
    promised = np.nan_to_num(top, nan=0.0).mean(axis=1)  # (Q,): no promise is a promise of 0
    delivered = relevant[:, :k].mean(axis=1)  # (Q,)
    return promised, delivered, withheld


def poisson_binomial(p: np.ndarray) -> np.ndarray:
    """(Q, k) probabilities of independent events -> (Q, k + 1): row q, column s = P(exactly s occur)."""
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"p must be (Q, k), got shape {p.shape}")
    dist = np.zeros((p.shape[0], p.shape[1] + 1))  # (Q, k + 1)
    dist[:, 0] = 1.0
    for j in range(p.shape[1]):
        pj = p[:, j : j + 1]  # (Q, 1)
        # one more event: s stays with 1 - p, s - 1 moves up with p (the right side is read first)
        dist[:, 1 : j + 2] = dist[:, 1 : j + 2] * (1.0 - pj) + dist[:, : j + 1] * pj
        dist[:, 0] *= 1.0 - p[:, j]
    return dist


def chance_figures(
    relevant: np.ndarray, relevance: np.ndarray, k: int = TOP_K
) -> tuple[np.ndarray, np.ndarray]:
    """(chance MAE, two-sided p-value), each (Q,), of each query's top ``k`` under its own promise
    (the module docstring; no promise = values of 0, as :func:`promised_delivered` counts it)."""
    promised, _, _ = promised_delivered(relevant, relevance, k)
    top = np.nan_to_num(np.asarray(relevance, dtype=np.float64)[:, :k], nan=0.0)  # (Q, k')
    dist = poisson_binomial(top)  # (Q, k' + 1)
    share = np.arange(top.shape[1] + 1) / max(top.shape[1], 1)  # (k' + 1,): delivered for each count
    chance_mae = (dist * np.abs(share[None, :] - promised[:, None])).sum(axis=1)  # (Q,)
    count = np.asarray(relevant, dtype=bool)[:, :k].sum(axis=1)  # (Q,)
    rows = np.arange(len(top))
    at_most = np.cumsum(dist, axis=1)[rows, count]  # (Q,) P(S <= count)
    at_least = 1.0 - at_most + dist[rows, count]  # (Q,) P(S >= count)
    return chance_mae, np.minimum(1.0, 2.0 * np.minimum(at_most, at_least))


def honesty_figures(
    promised: np.ndarray,
    delivered: np.ndarray,
    withheld: np.ndarray,
    chance: tuple[np.ndarray, np.ndarray],
    slack: float = SLACK,
) -> dict[str, Any]:
    """The module docstring's figures for one group of queries; ``chance``: their
    :func:`chance_figures`."""
    if len(promised) == 0:
        return {"queries": 0}
    gap = promised - delivered  # (Q,)
    return {
        "queries": int(len(promised)),
        "mae": float(np.abs(gap).mean()),
        "over": float(np.mean(gap > slack)),
        "under": float(np.mean(-gap > slack)),
        "withheld": float(np.mean(withheld)),
        "promised": float(promised.mean()),
        "delivered": float(delivered.mean()),
        "chance_mae": float(chance[0].mean()),
        "outside": float(np.mean(chance[1] < OUTSIDE_P)),
    }


def query_honesty(
    relevant: np.ndarray,
    relevance: np.ndarray,
    kinds: Sequence[str] | np.ndarray | None = None,
    k: int = TOP_K,
    slack: float = SLACK,
) -> dict[str, Any]:
    """``{"k", "slack", "pooled": figures, "by_kind": {kind: figures}}`` (see the module docstring)."""
    promised, delivered, withheld = promised_delivered(relevant, relevance, k)
    chance_mae, p_value = chance_figures(relevant, relevance, k)
    out: dict[str, Any] = {
        "k": int(k),
        "slack": float(slack),
        "pooled": honesty_figures(promised, delivered, withheld, (chance_mae, p_value), slack),
        "by_kind": {},
    }
    if kinds is not None:
        kinds = np.asarray(kinds)
        for kind in sorted(set(kinds.tolist())):
            rows = kinds == kind
            out["by_kind"][str(kind)] = honesty_figures(
                promised[rows], delivered[rows], withheld[rows], (chance_mae[rows], p_value[rows]), slack
            )
    return out


def ood_figures(relevance: np.ndarray, targets: Sequence[float] = OOD_TARGETS) -> dict[str, Any]:
    """For (Q, depth) relevance of out-of-domain queries (NaN rows: no promise): how many there are,
    the share given no promise, and per target the share of queries passing at least one hit."""
    relevance = np.asarray(relevance, dtype=np.float64)
    if relevance.ndim != 2:
        raise ValueError(f"relevance must be (Q, depth), got shape {relevance.shape}")
    best = np.where(np.isnan(relevance), -np.inf, relevance).max(axis=1, initial=-np.inf)  # (Q,)
    n = len(relevance)
    return {
        "queries": int(n),
        "withheld": float(np.isnan(relevance).all(axis=1).mean()) if n else None,
        "passing_any": {str(t): float(np.mean(best >= t)) if n else None for t in targets},
    }


def format_query_honesty(report: dict[str, Any]) -> str:
    """Per-query honesty of the served map: promised (mean relevance of the top k) vs delivered."""
    k, slack = report["k"], report["slack"]
    lines = [
        f"  per query, top {k} (served map; no promise = 0): promised vs delivered, "
        f"over/under by > {slack:g}",
        "    (chance: the MAE if every relevance shown were exactly right and the hits independent; "
        "outside: share of queries outside their promise's central 95 %)",
        f"    {'queries':<16} {'n':>5} {'MAE':>6} {'chance':>6} {'outside':>7} {'over':>6} {'under':>6} "
        f"{'no prom.':>8} {'promised':>8} {'delivered':>9}",
    ]
    for kind, g in [("pooled", report["pooled"]), *sorted(report["by_kind"].items())]:
        if not g["queries"]:
            continue
        chance = "".join(  # absent from calibrations written before the figures existed
            f" {g[key]:>{width}.3f}" if key in g else f" {'-':>{width}}"
            for key, width in (("chance_mae", 6), ("outside", 7))
        )
        lines.append(
            f"    {kind:<16} {g['queries']:>5} {g['mae']:>6.3f}{chance} {g['over']:>6.3f} {g['under']:>6.3f} "
            f"{g['withheld']:>8.3f} {g['promised']:>8.3f} {g['delivered']:>9.3f}"
        )
    return "\n".join(lines)


def format_out_of_domain(report: dict[str, Any]) -> str:
    """Out-of-domain queries: the share given no promise and the share passing any hit per threshold."""
    targets = list(report["all"]["passing_any"])
    head = "".join(f"{'pass@' + t:>9}" for t in targets)
    lines = [
        "  out-of-domain queries (held_out_kind: a kind left out of the fit)",
        f"    {'group':<16} {'n':>5} {'no prom.':>8}{head}",
    ]
    for group, g in report.items():
        if not g["queries"]:
            continue
        cells = "".join(f"{g['passing_any'][t]:>9.3f}" for t in targets)
        lines.append(f"    {group:<16} {g['queries']:>5} {g['withheld']:>8.3f}{cells}")
    return "\n".join(lines)
