"""The Markdown view of an ``icr bench`` report (its targets are checked in :mod:`bench.targets`)."""

from __future__ import annotations

from typing import Any

from bench.markdown import fmt as _fmt
from bench.markdown import table as _table
from bench.targets import _get


def _failed(section: dict[str, Any]) -> list[str]:
    failed = section.get("failed") or {}
    return [f"Failed to train: {', '.join(f'{k} ({v})' for k, v in failed.items())}.", ""] if failed else []


def _evaluation(e: dict[str, Any]) -> list[str]:
    full = e["full_metrics"]
    return [
        "## Evaluation",
        "",
        f"Every metric incl. PR-AUC on {e['images']:,} x {e['captions']:,} ({e['pairs']:,} pairs): "
        f"{full['median_ms'] / 1e3:.1f} s median (min {full['min_ms'] / 1e3:.1f}, "
        f"max {full['max_ms'] / 1e3:.1f}).",
        "",
    ]


def _build_section(b: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    tp = b.get("throughput") or {}
    lines += ["## Index build", ""]
    lines += _table(
        ["figure", "value"],
        [
            ["vectors", b["vectors"]],
            ["factory", f"`{b['factory']}`"],
            [
                "build wall time",
                f"{b['build_seconds']:.0f} s" + (" (cached build)" if b["cached"] else ""),
            ],
            ["peak RSS of the build", f"{b['peak_rss_mb']:.0f} MB"],
            *[[k.replace("_", " "), v] for k, v in tp.items()],
            ["recall@10 check", _get(b, "recall_check", "recall")],
        ],
    )
    if b.get("factory_reason"):
        lines += [f"Why `{b['factory']}`: {b['factory_reason']}", ""]
    return lines


def _search_section(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    e, a, x = r["end_to_end"], r["ann"], r["exact"]
    lines += [
        f"## In-process search, {r['vectors']:,} vectors (dim {r['dim']}, FAISS threads "
        f"{r['faiss_threads']}, depth {r['search_depth']})",
        "",
    ]
    lines += _table(
        ["stage", "p50 ms", "p99 ms"],
        [
            [stage, e[stage]["p50_ms"], e[stage]["p99_ms"]]
            for stage in ("encode", "search", "filter", "metadata", "total")
        ],
    )
    setting = f"efSearch {a['ef_search']}" if a.get("ef_search") else f"nprobe {a['nprobe']}"
    lines += _table(
        ["index", "recall@10 vs exact", "k=10 p50 ms", "k=10 p99 ms"],
        [
            [
                f"ANN `{a['factory']}` {setting}",
                a["recall_at_10_vs_exact"],
                a["k10_single"]["p50_ms"],
                a["k10_single"]["p99_ms"],
            ],
            *[
                [f"{label}, {t} thread(s)", 1.0, x[f"{key}{t}t"]["p50_ms"], x[f"{key}{t}t"]["p99_ms"]]
                for key, label in (
                    ("single_", "exact Flat"),
                    ("kernel_single_", "exact kernel (matrix-vector scan)"),
                )
                for t in (1, 2, 4, 8, 16)
                if f"{key}{t}t" in x
            ],
        ],
    )
    if "depth" in a:
        lines += [
            f"At the service's depth ({a['depth']:,} neighbours per query, the search stage above): "
            f"recall@10 {a['depth_recall_at_10']:.3f} and recall@{a['depth']:,} "
            f"{a['depth_recall_at_depth']:.3f} of exact.",
            "",
        ]
    lines += [
        f"Exact single query: floor {x['single_floor_ms']:.1f} ms (gallery bytes / read bandwidth); "
        f"best p50 is {x['single_best_p50_vs_floor']:.2f}x the floor.",
        "",
    ]
    depth = a.get("depth", "depth")
    lines += _table(
        [
            "exact batch",
            "floor ms",
            f"kernel ({x.get('kernel_precision', 'n/a')}) k=10 ms",
            "k=10 / floor",
            "queries/s",
            f"kernel k={depth} ms (scan)",
            f"k={depth} / floor",
            "FAISS k=10 ms",
        ],
        [
            [
                q,
                b["floor_ms"],
                b["search"]["median_ms"],
                b["vs_floor"],
                b["queries_per_s"],
                _depth_cell(b, x),
                b.get("depth_vs_floor"),
                _get(b, "faiss", "median_ms"),
            ]
            for q, b in x["batches"].items()
        ],
    )
    return lines


def _depth_cell(batch: dict[str, Any], exact: dict[str, Any]) -> str | None:
    """A batch's deep search time and the scan it took (its own, or the kernel's in older reports)."""
    ms = _get(batch, "depth_search", "median_ms")
    scan = batch.get("depth_precision", exact.get("depth_precision", exact.get("kernel_precision")))
    return None if ms is None else f"{ms:.1f} ({scan or 'n/a'})"


def markdown(report: dict[str, Any]) -> str:
    s, m = report["sections"], report["machine"]
    lines = [
        f"# icr bench: {report['host']}, {report['date']}"
        + (" (quick: smoke figures, not targets)" if report["quick"] else ""),
        "",
        f"`{report['command']}`; {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; torch {m['torch']}, "
        f"faiss {m['faiss']}; {report.get('seconds', 0) / 60:.1f} min. Figures are medians over repeats "
        "(spread in the JSON); latencies are p50/p99 over single queries.",
        "",
        "## Targets",
        "",
    ]
    lines += _table(
        ["target", "measured", "limit", "met", "why missed (this run's figures)"],
        [
            [
                t["target"],
                (_fmt(t["measured"], 3) + " " + t["unit"]).strip() if t["measured"] is not None else "n/a",
                f"{t['rule']} {t['limit']} {t['unit']}".strip(),
                {True: "yes", False: "**no**", None: "n/a"}[t["met"]],
                t.get("why") or ("" if t["met"] is not False else "not broken down by this run"),
            ]
            for t in report["targets"]
        ],
    )
    if "floors" in s:
        f = s["floors"]
        lines += ["## Floors (this run)", ""]
        lines += _table(
            ["figure", "value"],
            [
                [
                    f"read bandwidth, sgemv over the gallery ({f['bandwidth']['bytes'] / 1e9:.2f} GB)",
                    f"{f['bandwidth']['best_gbps']:.1f} GB/s",
                ],
                *[[f"  {k}", f"{v:.1f}"] for k, v in f["bandwidth"].items() if k.startswith("sgemv")],
                [
                    f"fp32 matmul rate, sgemm {f['matmul']['size']}",
                    f"{f['matmul']['best_gflops']:.0f} GFLOP/s",
                ],
                *[[f"  {k}", f"{v:.0f}"] for k, v in f["matmul"].items() if k.startswith("sgemm")],
            ],
        )
    if "build" in s:
        lines += _build_section(s["build"])
    for r in (s.get("search") or {}).values():
        lines += _search_section(r)
    for size, r in (s.get("http") or {}).items():
        lines += [f"## HTTP (`icr serve`), {int(size):,} distractors", ""]
        rows = []
        for name, by_clients in r.items():
            for c, row in by_clients.items():
                rows.append(
                    [
                        f"{name}, {c} client(s)",
                        row["latency"]["p50_ms"],
                        row["latency"]["p99_ms"],
                        row["queries_per_s"],
                        row["mean_batch"],
                        row["errors"],
                    ]
                )
        lines += _table(
            ["index, clients", "p50 ms", "p99 ms", "queries/s", "queries per FAISS call", "errors"], rows
        )
    from bench import ann_peers, cluster, filters, scale, writes  # sections that render themselves

    for name, render in (
        ("peers", ann_peers.markdown),
        ("filters", filters.markdown),
        ("scale", scale.markdown),
        ("cluster", cluster.markdown),
        ("writes", writes.markdown),
        ("eval", _evaluation),
    ):
        if name in s:
            lines += render(s[name])
    if "relevance" in s and "evaluation" in s["relevance"]:
        r = s["relevance"]
        ev = r["evaluation"]
        lines += [
            f"## Threshold honesty ({ev['queries']:,} held-out {ev['split']} captions, top {ev['depth']} of "
            f"the served index, judged on {ev['judged']}; calibrate {r['calibrate_s']:.0f} s, per-query map "
            f"{_get(r, 'per_query_map_ms', 'median_ms') or 0:.3f} ms per query)",
            "",
        ]
        rows = []
        for name, report in ev["maps"].items():
            for kind, g in [("pooled", report["pooled"]), *sorted(report["by_kind"].items())]:
                t = g["thresholds"]
                rows.append(
                    [
                        name,
                        kind,
                        g["queries"],
                        g["p_at_10"],
                        t["0.5"]["precision"],
                        t["0.5"]["passing"],
                        t["0.5"]["recall"],
                        t["0.8"]["precision"],
                        t["0.8"]["passing"],
                        t["0.5"]["share_below"],
                    ]
                )
        lines += _table(
            [
                "map",
                "queries",
                "n",
                "P@10",
                "precision at 0.5",
                "passing",
                "recall at 0.5",
                "precision at 0.8",
                "passing",
                "queries < 0.4 at 0.5",
            ],
            rows,
        )
        lines += _query_honesty_tables(ev)
    if "train" in s:
        t = s["train"]
        lines += [
            f"## Training step per objective (batch {t['batch']}, {t['steps']} steps x {t['rounds']} rounds, "
            f"`{t['config']}`)",
            "",
        ]
        lines += _table(
            [
                "objective",
                "captions/step",
                "step ms",
                "vs ntxent",
                "per caption vs ntxent",
                "loss fwd+bwd ms",
                "towers fwd+bwd ms",
                "decoder fwd+bwd ms",
                "peak RSS MB",
            ],
            [
                [
                    r["objective"],
                    r["captions_per_step"],
                    r["step_ms_median"],
                    r["vs_ntxent_median"],
                    r["per_caption_vs_ntxent"],
                    r["loss_fwd_bwd_ms_median"],
                    r.get("towers_fwd_bwd_ms_median"),  # n/a in results from before these columns
                    r.get("decoder_fwd_bwd_ms_median"),
                    r["peak_rss_mb"],
                ]
                for r in t["rows"]
            ],
        )
        lines += [
            "The towers column is both encoders' forward + backward alone and the decoder column "
            "LTD's/ITD's target decoder alone: an objective whose step exceeds its target by about "
            "what its towers or decoder add over ntxent's is at that floor, not slow in its loss.",
            "",
        ]
        lines += _failed(t)
    if "gpu" in s:
        lines += _gpu(s["gpu"])
    return "\n".join(lines)


def _gpu(g: dict[str, Any]) -> list[str]:
    """The GPU section: floors, exact and ANN search, the ANN's recall, training steps."""
    lines = ["## GPU", ""]
    if not g["ran"]:
        return [*lines, f"Not run: {g['device']}.", ""]
    f = g["search"]["floors"]
    lines += [
        f"{g['device']}: bandwidth {f['bandwidth_gbps']:.0f} GB/s, fp32 matmul "
        f"{f['matmul_tflops']:.1f} TFLOP/s.",
        "",
    ]
    lines += _table(
        ["batch", "floor ms", "exact ms", "exact / floor", "ANN ms"],
        [
            [q, r["floor_ms"], r["exact"]["median_ms"], r["exact_vs_floor"], r["ann"]["median_ms"]]
            for q, r in g["search"].items()
            if isinstance(r, dict) and "exact" in r
        ],
    )
    recall = g["search"].get("ann_recall_at_10_vs_exact")
    if recall is not None:
        lines += [
            f"ANN recall@10 against the exact GPU search over the same {g['search']['vectors']:,} "
            f"vectors: {recall:.3f} (queries: the first 1,024 indexed vectors).",
            "",
        ]
    lines += _table(
        ["objective", "step ms", "vs ntxent"],
        [[r["objective"], r["step_ms_median"], r["vs_ntxent_median"]] for r in g["train"]["rows"]],
    )
    lines += _failed(g["train"])
    return lines


def _per_query_table(first: str, honesty: dict[str, Any]) -> list[str]:
    """One per-query honesty report (query_honesty's) as a table: pooled, then each group."""
    rows = [
        [name, g["queries"], g["mae"], g.get("chance_mae"), g.get("outside")]
        + [g["over"], g["under"], g["withheld"], g["promised"], g["delivered"]]
        for name, g in [("pooled", honesty["pooled"]), *sorted(honesty["by_kind"].items())]
    ]
    head = [first, "n", "mean abs. gap", "of it chance", "outside 95 %", "over", "under", "no promise"]
    return _table([*head, "promised", "delivered"], rows)


def _query_honesty_tables(ev: dict[str, Any]) -> list[str]:
    """Per-query honesty of the served map and the out-of-domain queries (calibrations since format 3)."""
    lines: list[str] = []
    honesty = ev["maps"].get("per_query", {}).get("queries")
    if honesty:
        lines += [
            f"Per query, top {honesty['k']}: promised (mean relevance shown; no promise = 0) against "
            f"delivered (share truly relevant); of it chance: the mean gap if every value shown were "
            f"exactly right (hits independent); outside 95 %: share of queries whose delivered count lies "
            f"outside their promise's central 95 %; over / under: promised - delivered beyond "
            f"+/- {honesty['slack']:g}.",
            "",
            *_per_query_table("queries", honesty),
        ]
    generated = ev.get("generated")
    if generated:
        lines += [
            f"Generated queries ({generated['queries']:,}, {generated['no_answer']:,} with no answer in the "
            "index), per query, top 20, by style:",
            "",
            *_per_query_table("style", generated["honesty"]),
        ]
    ood = ev.get("out_of_domain")
    if ood:
        targets = list(ood["all"]["passing_any"])
        lines += ["Out-of-domain queries (held_out_kind: a kind left out of the calibration's fit):", ""]
        rows = [
            [group, g["queries"], g["withheld"], *(g["passing_any"][t] for t in targets)]
            for group, g in ood.items()
        ]
        lines += _table(["group", "n", "no promise", *(f"passing any at {t}" for t in targets)], rows)
    return lines
