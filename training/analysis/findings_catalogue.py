"""The papers' findings as data: every claim of the ECIR, LTD, Cross-Example Softmax and GOAL papers
that our variants can test, as ``Finding`` records (``FINDINGS``).

Mapping to our encoders: ECIR's VSE++ is our ``vsepp``; ECIR's VSRN (region features and a
relation-reasoning aggregator) is tested on our ``gpo`` encoder, the other precomputed-feature model
with learned aggregation; LTD's and Cross-Example Softmax's ResNet-50 towers are tested on ``vsepp``;
GOAL's tables are tested on ``gpo`` (its VSE-infinity base).

Importing this module checks every finding's paper-number keys, kind, encoder and paper, so a bad
reference fails when the catalogue is imported, not when the report is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from icr.training.analysis.compare import Variant
from icr.training.analysis.findings_verdict import (
    ABOVE,
    ANTI_RANKED,
    AT_LEAST,
    BEST_ALSO,
    ENCODERS,
    EQUALS,
    GREATER,
    KINDS,
    SIMILAR,
    Finding,
)
from icr.training.analysis.paper_numbers import ECIR_LOSSES, NUMBERS, PAPERS

ECIR_ENCODER = {"vsepp": "vsepp", "vsrn": "gpo"}
ECIR_VARIANT = {
    "triplet": "triplet",
    "triplet_sh": "triplet_hardest",
    "ntxent": "ntxent",
    "smoothap": "smoothap",
}
RSUM = "annotations/rsum"


def goal_variant(triplet_weight: str, pair_weight: str) -> str:
    """The comparison's name of a GOAL variant, e.g. ``goal[triplet_weight=cir,pair_weight=sig_ms]``."""
    params = (("triplet_weight", triplet_weight), ("pair_weight", pair_weight))
    return Variant("goal", params=params).name


def _ecir_t1(method: str, losses: Sequence[str], column: str) -> tuple[tuple[str, ...], ...]:
    return tuple(
        tuple(f"ecir.t1.{ds}.{method}.{loss}.{column}" for loss in losses) for ds in ("f30k", "coco")
    )


def _t1(
    method: str, slug: str, claim: str, a: str, b: str, kind: str = GREATER, note: str = "", col: str = "rsum"
) -> Finding:
    """An ECIR Table 1 finding on the encoder standing for ``method`` (``col``: a Table 1 column)."""
    enc = ECIR_ENCODER[method]
    metric = RSUM if col == "rsum" else f"annotations/{col.replace('_ar', ' ar')}"
    return Finding(
        f"ecir-t1-{slug}-{enc}",
        "ecir",
        "Table 1",
        claim,
        enc,
        kind,
        (ECIR_VARIANT[a], ECIR_VARIANT[b]),
        (metric,),
        _ecir_t1(method, (a, b), col),
        note=note,
    )


def _ecir_findings() -> list[Finding]:
    out: list[Finding] = []
    for method, label in (("vsepp", "VSE++"), ("vsrn", "VSRN")):

        def t1(*args: Any, **kwargs: Any) -> None:
            out.append(_t1(method, *args, **kwargs))  # noqa: B023 - called within this iteration

        t1(
            "sh-beats-triplet",
            f"Triplet loss SH outperforms the Triplet loss over all violating negatives ({label}, rsum)",
            "triplet_sh",
            "triplet",
        )
        t1(
            "sh-beats-ntxent",
            f"NT-Xent consistently underperforms Triplet loss SH ({label}, rsum)",
            "triplet_sh",
            "ntxent",
        )
        t1(
            "smoothap-not-above-sh",
            f"SmoothAP does not outperform Triplet loss SH ({label}, rsum)",
            "triplet_sh",
            "smoothap",
            AT_LEAST,
            "The paper's rows all have SH above SmoothAP; the claim tested is the paper's weaker one.",
        )
        t1(
            "smoothap-beats-ntxent",
            f"SmoothAP scores above NT-Xent ({label}, rsum)",
            "smoothap",
            "ntxent",
            note="Read from Table 1 (both datasets), not stated in the text.",
        )
        if method == "vsepp":
            t1(
                "ntxent-beats-triplet",
                "NT-Xent outperforms the Triplet loss over all negatives for VSE++ (rsum)",
                "ntxent",
                "triplet",
                note="Stated in Sect. 5 (rows 1.3/1.1 and 2.3/2.1) although NT-Xent counts more negatives.",
            )
            t1(
                "smoothap-similar-sh-i2t",
                "Only for VSE++ on i2t does SmoothAP perform similar to Triplet loss SH (i2t average recall)",
                "smoothap",
                "triplet_sh",
                SIMILAR,
                col="i2t_ar",
            )
        else:
            t1(
                "triplet-beats-ntxent",
                "For VSRN the Triplet loss over all negatives scores above NT-Xent (rsum)",
                "triplet",
                "ntxent",
                note="Read from Table 1 (rows 1.5/1.7, 2.5/2.7); the opposite of VSE++.",
            )
            t1(
                "sh-beats-smoothap-i2t",
                "For VSRN, Triplet loss SH outperforms SmoothAP on i2t (i2t average recall)",
                "triplet_sh",
                "smoothap",
                col="i2t_ar",
                note="Paper observation (4): SmoothAP is similar to SH only for VSE++ i2t.",
            )
        for d in ("i2t", "t2i"):
            t1(
                f"sh-beats-triplet-{d}",
                f"Triplet loss SH outperforms the Triplet loss on {d} too ({label}, {d} average recall)",
                "triplet_sh",
                "triplet",
                col=f"{d}_ar",
                note="Observation (1): SH gives the best scores 'regardless of dataset, method or task'.",
            )
            t1(
                f"sh-beats-ntxent-{d}",
                f"NT-Xent underperforms Triplet loss SH on {d} too ({label}, {d} average recall)",
                "triplet_sh",
                "ntxent",
                col=f"{d}_ar",
                note="Sect. 5: SH outperforms NT-Xent 'regardless of the method, dataset or sub-task'.",
            )
        t1(
            "smoothap-not-above-sh-t2i",
            f"SmoothAP does not outperform Triplet loss SH on t2i ({label}, t2i average recall)",
            "triplet_sh",
            "smoothap",
            AT_LEAST,
            col="t2i_ar",
            note="Observation (5), per task; on i2t the paper has SmoothAP similar to SH for VSE++ only.",
        )
        enc = ECIR_ENCODER[method]
        out.append(
            Finding(
                f"ecir-t1-best-recall-best-map-{enc}",
                "ecir",
                "Table 1",
                f"The loss with the best recall also has the highest mAP@5 ({label}, best rsum -> i2t mAP@5)",
                enc,
                BEST_ALSO,
                tuple(ECIR_VARIANT[x] for x in ECIR_VARIANT),
                (RSUM, "annotations/i2t mAP@5 (ECIR)"),
                _ecir_t1(method, tuple(ECIR_VARIANT), "rsum")
                + _ecir_t1(method, tuple(ECIR_VARIANT), "i2t_map5"),
                note="Observation (6): 'The method with the best Recall@k score also has the highest mAP@k "
                "score.' Tested as: the variant with the highest mean rsum is not below any other on mAP@5.",
            )
        )
    # COCOS (Tables 2-4)
    t2 = "ecir.t2.{ds}.{m}.{loss}.{col}"

    def ev(template: str, method: str, pairs: Sequence[tuple[str, str]]) -> tuple[tuple[str, ...], ...]:
        return tuple(
            tuple(template.format(ds=ds, m=method, loss=loss, col=col) for loss, col in pairs)
            for ds in ("f30k", "coco")
        )

    for direction in ("i2t", "t2i"):
        out.append(
            Finding(
                f"ecir-t2-triplet-counts-more-{direction}-vsepp",
                "ecir",
                "Table 2",
                f"At convergence the Triplet loss still has many violating negatives per query, "
                f"C^q(Triplet) >> C^q(Triplet SH) = 1 (VSE++, {direction})",
                "vsepp",
                GREATER,
                ("triplet", "triplet_hardest"),
                (f"cocos/{direction}_Cq",),
                ev(t2, "vsepp", [("triplet", f"{direction}_Cq"), ("triplet_sh", f"{direction}_Cq")]),
            )
        )
    out.append(
        Finding(
            "ecir-t2-triplet-cq-near-one-gpo",
            "ecir",
            "Table 2",
            "For VSRN, C^q(Triplet) ≈ C^q(Triplet SH) = 1: the Triplet loss too takes about one negative per "
            "query at convergence (i2t)",
            "gpo",
            EQUALS,
            ("triplet",),
            ("cocos/i2t_Cq",),
            ev(t2, "vsrn", [("triplet", "i2t_Cq")]),
            target=1.0,
            tolerance=0.5,
            note="Tolerance 0.5 covers the paper's VSRN values (i2t: 1.39, 1.21).",
        )
    )
    for enc, method in (("vsepp", "vsepp"), ("gpo", "vsrn")):
        out.append(
            Finding(
                f"ecir-t2-sh-cq-is-one-{enc}",
                "ecir",
                "Table 2",
                "Triplet loss SH: C^q = 1 (one hardest negative per contributing query)",
                enc,
                EQUALS,
                ("triplet_hardest",),
                ("cocos/i2t_Cq",),
                ev(t2, method, [("triplet_sh", "i2t_Cq")]),
                target=1.0,
                tolerance=1e-6,
                untestable="True by definition of the counter whenever a query contributes: a check of "
                "the counter, not a finding.",
            )
        )
    out.append(
        Finding(
            "ecir-t2-triplet-more-triplets-vsepp",
            "ecir",
            "Table 2",
            "C^B(Triplet) >> C^B(Triplet SH): many more contributing triplets per batch (VSE++, i2t)",
            "vsepp",
            GREATER,
            ("triplet", "triplet_hardest"),
            ("cocos/i2t_CB",),
            ev(t2, "vsepp", [("triplet", "i2t_CB"), ("triplet_sh", "i2t_CB")]),
            note="Sect. 5, of VSE++ (rows 1.1/1.2, 2.1/2.2): C^q and C^B of the Triplet loss are 'both "
            "much greater' than SH's 'for both dataset and both the the i2t and t2i task'. Not claimed for "
            "VSRN, where MS-COCO has the reverse (29.88 < 33.24).",
        )
    )
    out.append(
        Finding(
            "ecir-t2-sh-more-idle-queries-vsepp",
            "ecir",
            "Table 2",
            "More queries have no gradient under Triplet loss SH than under the Triplet loss, C^0(SH) > "
            "C^0(Triplet) (VSE++, i2t)",
            "vsepp",
            GREATER,
            ("triplet_hardest", "triplet"),
            ("cocos/i2t_C0",),
            ev(t2, "vsepp", [("triplet_sh", "i2t_C0"), ("triplet", "i2t_C0")]),
            note="Read from Table 2, not stated in the text.",
        )
    )
    for enc, method in (("vsepp", "vsepp"), ("gpo", "vsrn")):
        out.append(
            Finding(
                f"ecir-t3-ntxent-many-negatives-{enc}",
                "ecir",
                "Table 3",
                "NT-Xent: more than one negative has weight > ε per query, C^{qv-} > 1 (i2t)",
                enc,
                ABOVE,
                ("ntxent",),
                ("cocos/i2t_Cqv_neg",),
                tuple((f"ecir.t3.{ds}.{method}.ntxent.i2t_Cqv_neg",) for ds in ("f30k", "coco")),
                target=1.0,
                tolerance=0.05,
                note="Tolerance 0.05 (the paper's smallest value is 1.10). ε = 0.01.",
            )
        )
    out.append(
        Finding(
            "ecir-t4-smoothap-fewer-than-triplet-vsepp",
            "ecir",
            "Tables 2, 4",
            "SmoothAP takes about one triplet per query into account, far fewer than the Triplet loss "
            "(C^q, VSE++, i2t)",
            "vsepp",
            GREATER,
            ("triplet", "smoothap"),
            ("cocos/i2t_Cq",),
            tuple(
                (f"ecir.t2.{ds}.vsepp.triplet.i2t_Cq", f"ecir.t4.{ds}.vsepp.smoothap.i2t_Cq")
                for ds in ("f30k", "coco")
            ),
            note="Read from Tables 2 and 4 (SmoothAP 1.27 / 1.48 against the Triplet loss's 6.79 / 3.51); "
            "the text only says Table 4 is 'in line with the observations in Table 2'.",
        )
    )
    # The text's "approximately one triplet" fits its VSE++ values; its VSRN values (2.33, 1.67) do
    # not, so for VSRN the finding is the table's "a few", around 2.
    smoothap_cq = {
        "vsepp": (
            "At the optimal convergence point SmoothAP takes approximately one triplet into account per "
            "query, C^q(SmoothAP) ≈ 1 (i2t)",
            1.0,
            "Tolerance 0.5 covers the paper's VSE++ values (1.27, 1.48).",
        ),
        "gpo": (
            "For VSRN, SmoothAP takes a few triplets per query into account at convergence, "
            "C^q(SmoothAP) ≈ 2 (i2t)",
            2.0,
            "Read from Table 4 (2.33 on Flickr30k, 1.67 on MS-COCO; tolerance 0.5 covers both). The "
            "text's 'approximately one triplet' holds for VSE++ only; it singles out VSRN on Flickr30k as "
            "the run where SmoothAP counts the most negatives.",
        ),
    }
    for enc, method in (("vsepp", "vsepp"), ("gpo", "vsrn")):
        claim, target, note = smoothap_cq[enc]
        out.append(
            Finding(
                f"ecir-t4-smoothap-cq-near-one-{enc}",
                "ecir",
                "Table 4",
                claim,
                enc,
                EQUALS,
                ("smoothap",),
                ("cocos/i2t_Cq",),
                tuple((f"ecir.t4.{ds}.{method}.smoothap.i2t_Cq",) for ds in ("f30k", "coco")),
                target=target,
                tolerance=0.5,
                note=note,
            )
        )
        out.append(
            Finding(
                f"ecir-t4-smoothap-t2i-idle-{enc}",
                "ecir",
                "Table 4",
                "SmoothAP t2i (one positive per query): barely any query has a gradient at convergence, "
                "C^0(t2i) >> C^0(i2t)",
                enc,
                GREATER,
                ("smoothap", "smoothap"),
                ("cocos/t2i_C0", "cocos/i2t_C0"),
                tuple(
                    (f"ecir.t4.{ds}.{method}.smoothap.t2i_C0", f"ecir.t4.{ds}.{method}.smoothap.i2t_C0")
                    for ds in ("f30k", "coco")
                ),
                untestable="The paper's t2i values come from a wrong slice in the seed code's counter "
                "(seed-code notes 1.3): an artefact of that bug, not a property of SmoothAP. Ours counts "
                "caption queries correctly (C^0 is a count per batch and t2i has 5x more queries than i2t "
                "in image-level batches).",
            )
        )
    # For VSRN the paper calls the relation with the Triplet loss 'less clear' (its C^q, 1.39 / 1.21, is
    # below SmoothAP's 2.33 / 1.67 while its rsum is lower too); what it keeps there is SH vs SmoothAP
    for enc, method, losses in (
        ("vsepp", "vsepp", ("triplet", "triplet_sh", "smoothap")),
        ("gpo", "vsrn", ("triplet_sh", "smoothap")),
    ):
        out.append(
            Finding(
                f"ecir-cocos-more-contributors-lower-score-{enc}",
                "ecir",
                "Tables 1, 2, 4",
                "The more negatives contribute to the gradient at convergence (C^q), the lower the score "
                f"(rsum): {', '.join(ECIR_LOSSES[x] for x in losses)}",
                enc,
                ANTI_RANKED,
                tuple(ECIR_VARIANT[x] for x in losses),
                ("cocos/i2t_Cq", RSUM),
                tuple(
                    # SmoothAP's counts are in Table 4, the triplet losses' in Table 2
                    tuple(f"ecir.t{4 if x == 'smoothap' else 2}.{ds}.{method}.{x}.i2t_Cq" for x in losses)
                    for ds in ("f30k", "coco")
                )
                + _ecir_t1(method, losses, "rsum"),
                note="Sect. 5 (the SmoothAP paragraph). NT-Xent is left out: its count is another quantity "
                "(C^{qv-}) and the paper says the relation does not hold for it."
                + (
                    " For VSRN the Triplet loss is left out too: the paper calls its relation 'less clear', "
                    "and keeps 'the only experiment where the Triplet loss SH outperforms SmoothAP with a "
                    "large margin ... takes the highest number of negatives into account'."
                    if method == "vsrn"
                    else ""
                ),
            )
        )
    return out


def _ltd_findings() -> list[Finding]:
    bl, dual, lag, itd = "ntxent", "ntxent+ltd:dual", "ntxent+ltd:constraint", "ntxent+itd:constraint"
    itd_dual = "ntxent+itd:dual"
    bl_tau, lag_tau = "ntxent[temperature=0.05]", "ntxent[temperature=0.05]+ltd:constraint"
    rows = {bl: "bl_con", dual: "ltd_dual", lag: "ltd_lag", itd: "itd_lag", itd_dual: "itd_dual"}
    rows |= {bl_tau: "bl_con", lag_tau: "ltd_lag"}

    def f(
        slug: str, claim: str, a: str, b: str, kind: str = GREATER, metric: str = RSUM, **kw: Any
    ) -> Finding:
        col = {
            "annotations/rsum": "rsum",
            "ground_truth/rsum": "rsum",
            "ground_truth/i2t R-prec": "i2t_rprec",
        }[metric]
        datasets = kw.pop("datasets", ("f30k", "coco"))
        return Finding(
            f"ltd-t1-{slug}-vsepp",
            "ltd",
            "Table 1",
            claim,
            "vsepp",
            kind,
            (a, b),
            (metric,),
            tuple((f"ltd.t1.{ds}.{rows[a]}.{col}", f"ltd.t1.{ds}.{rows[b]}.{col}") for ds in datasets),
            **kw,
        )

    return [
        f(
            "constraint-beats-baseline",
            "Constraint-based LTD outperforms the contrastive-only baseline by a large margin (rsum)",
            lag,
            bl,
            note="Sect. 5.1. At ECIR's InfoNCE temperature 0.1; the paper uses 0.05 (the next row).",
        ),
        f(
            "constraint-beats-baseline-paper-tau",
            "Constraint-based LTD outperforms the contrastive-only baseline by a large margin (rsum; both "
            "at the paper's InfoNCE temperature 0.05)",
            lag_tau,
            bl_tau,
            note="The same claim as above at LTD's own temperature; the rows above use ECIR's 0.1.",
        ),
        f("constraint-beats-dual", "LTD as a constraint (L_lag) beats LTD as a dual loss (rsum)", lag, dual),
        f(
            "dual-similar-baseline",
            "LTD as a dual loss does not convincingly outperform the baseline (rsum)",
            dual,
            bl,
            SIMILAR,
        ),
        f(
            "ltd-beats-itd",
            "Latent target decoding beats input target decoding, both as constraints (rsum)",
            lag,
            itd,
            note="Read from Table 1 (341.4 against 400.9, 313.7 against 329.7); the text says 'unlike "
            "reconstructing the input caption, LTD reduces shortcut learning'. The paper's thresholds "
            "differ: η = 6 for ITD, 0.2 for LTD.",
        ),
        f(
            "itd-constraint-hurts",
            "ITD as an optimization constraint even hurts: the baseline beats it (rsum)",
            bl,
            itd,
        ),
        f(
            "itd-dual-similar-baseline",
            "ITD as a dual loss gives no clear recall improvement over the baseline (rsum)",
            itd_dual,
            bl,
            SIMILAR,
            note="Sect. 5.2: 'implementing ITD as a dual loss does not result in improved recall@k scores, "
            "for most values of k'. Table 1 goes both ways (rsum 375.2 < 381.9 on Flickr30k, 320.8 > 317.7 "
            "on MS-COCO), so the claim is ≈, not 'not above'.",
        ),
        f(
            "itd-constraint-below-dual",
            "ITD as an optimization constraint scores even lower than ITD as a dual loss (rsum)",
            itd_dual,
            itd,
            note="Sect. 5: 'when we implement ITD as an optimization constraint ... the evaluation scores "
            "are "
            "even lower ... than when implemented as a dual loss'.",
        ),
        f(
            "constraint-beats-baseline-cxc",
            "Constraint-based LTD beats the baseline also with extended relevance (CxC; our ground truth, "
            "rsum)",
            lag,
            bl,
            metric="ground_truth/rsum",
            datasets=("cxc",),
            note="CxC adds similar-caption and similar-image annotations; our benchmark's ground truth plays "
            "that role.",
        ),
        f(
            "constraint-rprec",
            "Higher recall with constraint-based LTD comes with higher R-precision (i2t, ground truth)",
            lag,
            bl,
            metric="ground_truth/i2t R-prec",
            datasets=("f30k", "coco", "cxc"),
        ),
    ]


def _ces_findings() -> list[Finding]:
    ss, ces, mining = "sampled_softmax", "cross_example_softmax", "cross_example_mining"
    names = {ss: "sampled_softmax", ces: "ce_softmax", mining: "ce_mining", "snm": "snm"}
    pr_auc = "calibration/PR-AUC (annotations)"

    def f(
        slug: str,
        claim: str,
        a: str,
        b: str,
        metric: str,
        cols: Sequence[str],
        kind: str = GREATER,
        **kw: Any,
    ) -> Finding:
        return Finding(
            f"ces-t1-{slug}-vsepp",
            "ces",
            "Table 2" if all(c.startswith("t2.") for c in cols) else "Table 1",
            claim,
            "vsepp",
            kind,
            (a, b),
            (metric,),
            tuple(
                (
                    f"ces.{'t2.f30k' if c.startswith('t2.') else 't1.cc'}.{names[a]}.{c.removeprefix('t2.')}",
                    f"ces.{'t2.f30k' if c.startswith('t2.') else 't1.cc'}.{names[b]}.{c.removeprefix('t2.')}",
                )
                for c in cols
            ),
            **kw,
        )

    return [
        f(
            "ces-calibrates",
            "Cross-Example Softmax improves global calibration: PR-AUC above Sampled Softmax",
            ces,
            ss,
            pr_auc,
            ("pr_auc",),
        ),
        f(
            "ces-calibrates-truth",
            "Cross-Example Softmax PR-AUC above Sampled Softmax, with our complete ground-truth relevance",
            ces,
            ss,
            "calibration/PR-AUC (ground truth)",
            ("pr_auc",),
            note="The paper labels only the annotated pairs; the ground truth is our benchmark's extension.",
        ),
        f(
            "mining-calibrates",
            "Cross-Example Negative Mining also raises PR-AUC above Sampled Softmax",
            mining,
            ss,
            pr_auc,
            ("pr_auc",),
            note="Read from Table 1 (PR-AUC 20.09 against 14.61), not stated in the text.",
        ),
        f(
            "mining-similar-ces-prauc",
            "Cross-Example Negative Mining and Cross-Example Softmax calibrate alike (PR-AUC)",
            mining,
            ces,
            pr_auc,
            ("pr_auc",),
            SIMILAR,
            note="Read from Table 1 (PR-AUC 20.09 against 20.12), not stated in the text.",
        ),
        f(
            "ces-recall-not-worse",
            "On the test set alone, Cross-Example Softmax is not worse on recall (R@1 higher, no large "
            "differences at larger k; t2i R@1)",
            ces,
            ss,
            "annotations/t2i R@1",
            ("t2i_r1",),
            AT_LEAST,
        ),
        *(
            f(
                f"{slug}-distractors{'' if k == 10 else f'-r{k}'}",
                f"{claim} (t2i R@{k} with distractors)",
                a,
                b,
                f"calibration/t2i R@{k} +distractors (annot.)",
                (f"t2i_r{k}_distr",),
            )
            for k in (1, 5, 10, 100)
            for slug, claim, a, b in (
                (
                    "ces-beats-ss",
                    "With many distractor images, Cross-Example Softmax clearly outperforms Sampled Softmax "
                    "across all levels of k",
                    ces,
                    ss,
                ),
                (
                    "mining-beats-ces",
                    "Cross-Example Negative Mining further improves on Cross-Example Softmax with "
                    "distractors",
                    mining,
                    ces,
                ),
            )
        ),
        f(
            "ces-beats-ss-zero-shot",
            "Trained on Conceptual Captions and tested on Flickr30k without fine-tuning, Cross-Example "
            "Softmax outperforms the baselines across all levels of k (t2i R@1)",
            ces,
            ss,
            "annotations/t2i R@1",
            ("t2.t2i_r1", "t2.t2i_r5", "t2.t2i_r10"),
            untestable="Zero-shot transfer from one dataset to another: the embedded benchmark has one "
            "domain, so no run here trains on one collection and tests on another.",
        ),
        f(
            "snm-similar-ss-prauc",
            "Stochastic Negative Mining (per-query top-k) leaves calibration where Sampled Softmax has it "
            "(PR-AUC)",
            "snm",
            ss,
            pr_auc,
            ("pr_auc",),
            SIMILAR,
            note="Read from Table 1 (PR-AUC 14.80 against 14.61), not stated in the text.",
        ),
    ]


def _goal_findings() -> list[Finding]:
    out: list[Finding] = []
    settings = (("t5", "vseinf_butd"), ("t5", "vseinf_wsl"), ("t3", "vsepp_r152"))
    # the triplet-weight claims are the paper's for the fine-tuning step and VSE-infinity (Table 5);
    # on the frozen VSE++ rows of Table 3 its own numbers go the other way for some of them
    table5 = (("t5", "vseinf_butd"), ("t5", "vseinf_wsl"))

    def f(
        slug: str,
        claim: str,
        a: tuple[str, str],
        b: tuple[str, str],
        direction: str,
        kind: str = GREATER,
        table: str = "Tables 3-5",
        note: str = "",
        settings: tuple[tuple[str, str], ...] = settings,
        prefix: str = "goal-t5",
    ) -> Finding:
        return Finding(
            f"{prefix}-{slug}-{direction}-gpo",
            "goal",
            table,
            claim + f" ({direction} R@1)",
            "gpo",
            kind,
            (goal_variant(*a), goal_variant(*b)),
            (f"annotations/{direction} R@1",),
            tuple(
                (
                    f"goal.{t}.coco.{m}.{a[0]}.{a[1]}.{direction}_r1",
                    f"goal.{t}.coco.{m}.{b[0]}.{b[1]}.{direction}_r1",
                )
                for t, m in settings
            ),
            note=note,
        )

    for d in ("i2t", "t2i"):
        out.append(
            f(
                "sigms-beats-con",
                "With T_con, P_sig-ms (the MS loss) beats P_con (the triplet loss)",
                ("con", "sig_ms"),
                ("con", "con"),
                d,
            )
        )
        out.append(
            f(
                "cir-sigms-beats-con-con",
                "T_cir x P_sig-ms, the paper's best, beats T_con x P_con (triplet loss)",
                ("cir", "sig_ms"),
                ("con", "con"),
                d,
            )
        )
        out.append(
            Finding(
                f"goal-t5-cir-sigms-beats-triplet-hardest-{d}-gpo",
                "goal",
                "Tables 2, 5",
                f"T_cir x P_sig-ms beats the hardest-negative triplet loss itself ({d} R@1)",
                "gpo",
                GREATER,
                (goal_variant("cir", "sig_ms"), "triplet_hardest"),
                (f"annotations/{d} R@1",),
                tuple(
                    (f"goal.t5.coco.{m}.cir.sig_ms.{d}_r1", f"goal.t2.coco.{m}.original.{d}_r1")
                    for m in ("vseinf_butd", "vseinf_wsl")
                ),
            )
        )
    out.append(
        Finding(
            "goal-t2-gradient-equals-triplet-i2t-gpo",
            "goal",
            "Table 2",
            "Training with the gradient T_con x P_con is equivalent to the hardest-negative triplet loss "
            "(i2t R@1)",
            "gpo",
            SIMILAR,
            (goal_variant("con", "con"), "triplet_hardest"),
            ("annotations/i2t R@1",),
            tuple(
                (f"goal.t2.coco.{m}.ours.i2t_r1", f"goal.t2.coco.{m}.original.i2t_r1")
                for m in ("vseinf_butd", "vseinf_wsl")
            ),
        )
    )
    out.append(
        f(
            "sig-beats-con",
            "With T_con, P_sig (binomial deviance) beats P_con",
            ("con", "sig"),
            ("con", "con"),
            "i2t",
        )
    )
    out.append(
        f("linms-beats-con", "With T_con, P_lin-ms beats P_con", ("con", "lin_ms"), ("con", "con"), "i2t")
    )
    out.append(
        f(
            "lin-beats-con",
            "With T_con, P_lin beats P_con",
            ("con", "lin"),
            ("con", "con"),
            "i2t",
            note="Stated for Tables 3 and 4 (VSE++); in Table 5 (VSE∞ BUTD) P_lin is below P_con "
            "(58.1 < 58.9).",
        )
    )
    out.append(
        f(
            "cir-improves-sigms",
            "T_cir improves on the MS loss (T_con x P_sig-ms)",
            ("cir", "sig_ms"),
            ("con", "sig_ms"),
            "i2t",
            table="Table 5",
            settings=table5,
        )
    )
    out.append(
        f(
            "nca-improves-sigms",
            "T_NCA improves on the MS loss (T_con x P_sig-ms)",
            ("nca", "sig_ms"),
            ("con", "sig_ms"),
            "i2t",
            table="Table 5",
            settings=table5,
        )
    )
    out.append(
        f(
            "nca-beats-con",
            "With P_con, T_NCA beats T_con",
            ("nca", "con"),
            ("con", "con"),
            "i2t",
            table="Table 5",
            settings=table5,
        )
    )
    for d in ("i2t", "t2i"):
        out.append(
            f(
                "circle-beats-triplet",
                "Circle loss (T_cir x P_lin), one of the DML losses of Table 1, performs better than the "
                "triplet loss (T_con x P_con)",
                ("cir", "lin"),
                ("con", "con"),
                d,
                table="Tables 1, 3",
                settings=(("t3", "vsepp_r152"), ("t3", "vsepp_r152_ft")),
                prefix="goal-t3",
                note="'All DML loss functions mentioned in Table 1 perform better than triplet loss in "
                "both steps' (Sect. 5, Table 3: frozen and fine-tuned VSE++).",
            )
        )
    return out


FINDINGS: tuple[Finding, ...] = (*_ecir_findings(), *_ltd_findings(), *_ces_findings(), *_goal_findings())


def _ensure_paper_numbers(finding_list: Sequence[Finding]) -> None:
    for f in finding_list:
        unknown = [k for k in f.paper_keys() if k not in NUMBERS]
        if unknown:
            raise KeyError(f"finding {f.id}: unknown paper numbers {unknown}")
        if f.kind not in KINDS or f.encoder not in ENCODERS or f.paper not in PAPERS:
            raise ValueError(f"finding {f.id}: bad kind, encoder or paper")


_ensure_paper_numbers(FINDINGS)
__all__ = ["FINDINGS", "goal_variant"]
