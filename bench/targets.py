"""The targets of an ``icr bench`` report, checked: each a measured figure against its limit, with
what the same run's own figures say about a miss."""

from __future__ import annotations

from typing import Any


def _get(d: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _target(
    name: str, measured: float | None, limit: float, below: bool, unit: str = "", why: str | None = None
) -> dict[str, Any]:
    """One target row; ``why``: what this run's own figures say about a miss (kept only on a miss)."""
    met = None if measured is None else (measured < limit if below else measured >= limit)
    return {
        "target": name,
        "measured": measured,
        "limit": limit,
        "unit": unit,
        "rule": "<" if below else ">=",
        "met": met,
        "why": why if met is False else None,
    }


# Why a target was missed, from the figures the same run measured beside it (None: none to read).


def _why_query_mae(worst: dict[str, Any] | None) -> str | None:
    if worst is None:
        return None
    return (
        f"worst kind {worst['kind']}: {worst['chance_mae']:.3f} of its {worst['mae']:.3f} is chance alone "
        f"(the MAE if each relevance shown were exactly right and its hits independent: only sharper values, "
        f"from a model that tells relevant hits from near misses, lower it); {worst['outside']:.1%} of its "
        f"queries fall outside their promise's 95 % range (5 % expected of an honest map)"
    )


def _why_http_p99(search: Any, http: Any) -> str | None:
    lat, inproc = _get(http, "ann", "1", "latency"), _get(search, "end_to_end", "total", "p99_ms")
    if lat is None or inproc is None:
        return None
    return (
        f"in-process p99 is {inproc:.1f} ms; over HTTP p50 is {lat['p50_ms']:.1f} ms and p99 "
        f"{lat['p99_ms']:.1f} ms: the tail is the HTTP round trip (server, client and load on 2 shared cores)"
    )


def _why_ann_depth(build: Any, search: Any) -> str | None:
    check = _get(build, "recall_check")
    if not check or check.get("recall_at_depth") is None:
        return None
    setting = f"nprobe {check['nprobe']}" if check.get("nprobe") else "its setting"
    here = _get(search, "ann", "depth_recall_at_depth")
    return (
        f"the build tuned {setting} on {check['queries']} held-out queries, where recall@{check['depth']:,} "
        f"was {check['recall_at_depth']:.3f}; these queries measure {here:.3f}"
    )


def _ours_against_peers(peers: dict[str, Any], workload: str) -> tuple[float | None, str | None]:
    """Our fastest engine's paired p50 over the fastest peer's, for ``workload`` (``k10`` or
    ``depth``), among the engines whose setting met its recall targets, and the two figures; None
    where either side has none."""
    best = {
        e["engine"]: e[f"best_{workload}"].get("paired_p50_ms", e[f"best_{workload}"]["p50_ms"])
        for e in peers["engines"]
        if e.get(f"best_{workload}")
    }
    ours = {name: ms for name, ms in best.items() if name.startswith("ours:")}
    theirs = {name: ms for name, ms in best.items() if not name.startswith("ours:")}
    if not ours or not theirs:
        return None, None
    us, them = min(ours, key=ours.__getitem__), min(theirs, key=theirs.__getitem__)
    why = f"our fastest, {us}, takes {ours[us]:.2f} ms; the fastest peer, {them}, {theirs[them]:.2f} ms"
    return ours[us] / theirs[them], why


def _peer_targets(peers: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Ours against the fastest peer at k = 10 (p50 no slower) and at the service's depth (0.8x),
    one query per call on one thread, paired timings (bench/ann_peers.py)."""
    if peers is None:
        return []
    deep = peers["depth"]
    out = []
    for workload, limit, where in (
        ("k10", 1.0, "k = 10 (recall@10 >= 0.98)"),
        ("depth", 0.8, f"depth {deep:,} (recall@10 >= 0.98, recall@{deep:,} >= 0.95)"),
    ):
        ratio, why = _ours_against_peers(peers, workload)
        out.append(_target(f"ANN at {where}: our p50 / the fastest peer's", ratio, limit, True, "x", why))
    return out


def _why_build(build: dict[str, Any]) -> str | None:
    t = build.get("timings") or {}
    stream = t.get("distractor_render_seconds", 0.0) + t.get("distractor_embed_seconds", 0.0)
    if not stream:
        return None
    rest = build["build_seconds"] - stream - t.get("gallery_embed_seconds", 0.0)
    return (
        f"rendering and embedding the distractors took {stream:.0f} s; training and filling the index, "
        f"the recall check and the --factory auto trials the other {rest:.0f} s"
    )


def _why_exact_single(exact: Any, floors: Any) -> str | None:
    one = _get(exact, "single_1t", "p50_ms")
    gbps1, gbps = _get(floors, "bandwidth", "sgemv_1t_gbps"), _get(floors, "bandwidth", "best_gbps")
    if None in (one, gbps1, gbps) or not exact.get("bytes"):
        return None
    floor1 = exact["bytes"] / gbps1 / 1e6
    # the bench times one thread and every core (single_{threads}t)
    timed = [k[len("single_") : -1] for k in exact if k.startswith("single_") and k.endswith("t")]
    threads = max((int(t) for t in timed if t.isdigit()), default=1)
    many = _get(exact, f"single_{threads}t", "p50_ms") if threads > 1 else None
    two_note = f"; on {threads} threads FAISS takes {many:.1f} ms" if many is not None else ""
    scan = _get(exact, f"kernel_single_{threads}t", "p50_ms")
    scan_note = f", the kernel's matrix-vector scan {scan:.1f} ms" if scan is not None else ""
    return (
        f"one core reads {gbps1:.1f} GB/s, all cores {gbps:.1f} GB/s (the floor's figure); one-thread "
        f"FAISS takes {one:.1f} ms, {one / floor1:.2f}x the one-core floor of {floor1:.1f} ms"
        f"{two_note}{scan_note}"
    )


def _why_exact_batch(
    row: Any, stage: str, k_label: str, precision: str | None, searched: str | None = None
) -> str | None:
    """``precision``: the kernel's scan (what ``matmul`` timed); ``searched``: the pass this stage
    took, if not that scan (a bf16 kernel's deep searches take the fp32 pass)."""
    search, matmul = _get(row, stage, "median_ms"), _get(row, "matmul", "median_ms")
    if search is None or matmul is None:
        return None
    if searched == "fp32" and precision == "bf16":
        return (
            f"at this depth the kernel takes its fp32 pass, which scores, compares and keeps the "
            f"{k_label} in {search:.1f} ms (the bf16 scan's candidates would cost more); its bf16 "
            f"scoring alone takes {matmul:.1f} ms ({matmul / row['floor_ms']:.2f}x the floor)"
        )
    if precision == "fp32":  # scoring and comparing are one compiled pass (icr.core.threshold_scan)
        return (
            f"the kernel's fp32 scoring alone, every score written out, takes {matmul:.1f} ms "
            f"({matmul / row['floor_ms']:.2f}x the floor); the fused pass that compares while it scores, "
            f"with the {k_label} kept, takes {search:.1f} ms"
        )
    return (
        f"the kernel's {precision + ' ' if precision else ''}scoring alone, every score written out, "
        f"takes {matmul:.1f} ms ({matmul / row['floor_ms']:.2f}x the floor); selecting the {k_label} "
        f"(compare, top-k, fp32 rescoring) takes the other {search - matmul:.1f} ms"
    )


def _why_micro_batching(http: Any, search: Any) -> str | None:
    many, one = _get(http, "exact", "16"), _get(http, "exact", "1", "latency", "p50_ms")
    depth_16, depth = (
        _get(search, "exact", "batches", "16", "depth_search", "median_ms"),
        _get(search, "ann", "depth"),
    )
    if many is None or one is None or depth_16 is None:
        return None
    why = (
        f"16 clients averaged {many['mean_batch']:.1f} queries per search call; the service searches "
        f"depth {depth}, where a batch of 16 takes {depth_16:.0f} ms against {one:.0f} ms for one query "
        f"over HTTP, so even full batches give at most {16 * one / depth_16:.1f}x"
    )
    # the ANN index's search is a millisecond or two: what 16 clients get from it is the service's own
    # ceiling (HTTP, encoding the text, relevance), whatever the exact search costs
    ann_16, exact_1 = _get(http, "ann", "16", "queries_per_s"), _get(http, "exact", "1", "queries_per_s")
    if ann_16 and exact_1:
        why += (
            f"; the ANN index served 16 clients {ann_16:.0f} queries/s, so the work outside the search "
            f"caps exact near {ann_16 / exact_1:.1f}x"
        )
    return why


def _why_kinds(relevance: Any, below: float) -> str | None:
    kinds = _get(relevance, "evaluation", "maps", "per_query", "by_kind")
    if not kinds:
        return None
    low = sorted(
        (g["p_at_10"], k) for k, g in kinds.items() if g.get("p_at_10") is not None and g["p_at_10"] < below
    )
    return "P@10 below {:.1f}: {}".format(below, ", ".join(f"{k.replace('_', ' ')} {p:.3f}" for p, k in low))


def _why_train(row: dict[str, Any], ntxent: dict[str, Any] | None) -> str | None:
    towers, loss = row.get("towers_fwd_bwd_ms_median"), row.get("loss_fwd_bwd_ms_median")
    decoder = row.get("decoder_fwd_bwd_ms_median") or 0.0
    if ntxent is None or towers is None or loss is None:
        return None
    base = ntxent.get("towers_fwd_bwd_ms_median")
    parts = [
        f"{row['captions_per_step']} captions per step (ntxent {ntxent['captions_per_step']})",
        f"both towers' forward+backward alone {towers:.0f} ms"
        + (f" ({towers / base:.2f}x ntxent's)" if base else ""),
        f"the loss {loss:.1f} ms",
    ]
    if decoder:
        parts.append(f"the objective's decoder {decoder:.0f} ms ({decoder / towers:.2f}x the towers)")
    return "; ".join(parts)


def _why_workers(cluster: Any) -> str | None:
    single = _get(cluster, "layouts", "single")
    if not single:
        return None
    one, sixteen = single["1"], single["16"]
    return (
        f"one process: {one['queries_per_s']:.0f} queries/s for one client at p50 "
        f"{one['latency']['p50_ms']:.1f} ms, {sixteen['queries_per_s']:.0f}/s for 16; the 16 client "
        "threads share the same 2 cores"
    )


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    s = report["sections"]
    size = max((int(k) for k in s.get("search", s.get("http", {}))), default=None)
    key = str(size) if size is not None else ""
    search, http = _get(s, "search", key), _get(s, "http", key)
    out = [
        _target(
            f"in-process single query p99 ({key} distractors)",
            _get(search, "end_to_end", "total", "p99_ms"),
            10,
            True,
            "ms",
        ),
        _target(
            f"HTTP single client p99 ({key})",
            _get(http, "ann", "1", "latency", "p99_ms"),
            15,
            True,
            "ms",
            _why_http_p99(search, http),
        ),
        _target("ANN recall@10 of exact", _get(search, "ann", "recall_at_10_vs_exact"), 0.95, False),
    ]
    depth = _get(search, "ann", "depth")
    if depth is not None:  # the ANN index at the service's depth (1,000), where it is used
        out += [
            _target(
                f"ANN at depth {depth}: recall@10 of exact",
                _get(search, "ann", "depth_recall_at_10"),
                0.98,
                False,
            ),
            _target(
                f"ANN at depth {depth}: recall@{depth} of exact",
                _get(search, "ann", "depth_recall_at_depth"),
                0.95,
                False,
                why=_why_ann_depth(s.get("build"), search),
            ),
            _target(
                f"ANN search of depth {depth}, in-process p99 ({key})",
                _get(search, "end_to_end", "search", "p99_ms"),
                5,
                True,
                "ms",
            ),
        ]
    out += _peer_targets(s.get("peers"))
    inproc, over_http = (
        _get(search, "end_to_end", "total", "p50_ms"),
        _get(http, "ann", "1", "latency", "p50_ms"),
    )
    out.append(
        _target(
            "service overhead: HTTP p50 / in-process p50",
            over_http / inproc if inproc and over_http else None,
            1.5,
            True,
            "x",
        )
    )
    out.append(
        _target(
            "exact single query p50 / bandwidth floor",
            _get(search, "exact", "single_best_p50_vs_floor"),
            1.3,
            True,
            "x",
            _why_exact_single(_get(search, "exact"), s.get("floors")),
        )
    )
    precision = _get(search, "exact", "kernel_precision")
    for batch in ("16", "64"):
        out.append(
            _target(
                f"exact batch of {batch} / matmul floor",
                _get(search, "exact", "batches", batch, "vs_floor"),
                1.3,
                True,
                "x",
                _why_exact_batch(_get(search, "exact", "batches", batch), "search", "top 10", precision),
            )
        )
        if _get(search, "exact", "batches", batch, "depth_vs_floor") is not None:
            out.append(
                _target(
                    f"exact batch of {batch} at depth {depth} / matmul floor",
                    _get(search, "exact", "batches", batch, "depth_vs_floor"),
                    1.3,
                    True,
                    "x",
                    _why_exact_batch(
                        _get(search, "exact", "batches", batch),
                        "depth_search",
                        f"top {depth}",
                        precision,
                        _get(search, "exact", "batches", batch, "depth_precision")
                        or _get(search, "exact", "depth_precision")  # reports before 2026-11-28 (2)
                        or precision,
                    ),
                )
            )
    one, sixteen = _get(http, "exact", "1", "queries_per_s"), _get(http, "exact", "16", "queries_per_s")
    out.append(
        _target(
            "exact search QPS, 16 clients / 1 client (micro-batching)",
            sixteen / one if one and sixteen else None,
            10,
            False,
            "x",
            _why_micro_batching(http, search),
        )
    )
    build = _get(s, "build")
    if build and not build["cached"] and build["distractors"] >= 1_000_000:  # a 1M build from nothing
        out.append(
            _target(
                f"index build from nothing, {build['distractors']:,} generated distractors",
                build["build_seconds"],
                360,
                True,
                "s",
                _why_build(build),
            )
        )
    on_disk = _get(s, "scale", "on_disk")
    if on_disk is not None:
        out.append(
            _target(
                f"{on_disk['vectors']:,}-vector {on_disk['factory']} from shards: build peak RSS",
                on_disk["peak_rss_mb_build"],
                on_disk["budget_mb"],
                True,
                "MB",
            )
        )
        if "search" in on_disk:
            from bench.scale import best_recall_within

            out.append(
                _target(
                    f"{on_disk['vectors']:,}-vector on-disk index: best recall@10 at p50 <= 10 ms",
                    best_recall_within(on_disk, 10.0),
                    0.95,
                    False,
                )
            )
    relevance = _get(s, "relevance", "summary")
    if relevance is not None:
        out += [
            _target(
                "held-out P@10, pooled (served index)",
                relevance["p_at_10"],
                0.8,
                False,
                why=_why_kinds(s["relevance"], 0.8),
            ),
            _target(
                "held-out P@10, worst query kind",
                relevance["worst_kind_p_at_10"],
                0.6,
                False,
                why=_why_kinds(s["relevance"], 0.6),
            ),
            _target(
                "min_relevance 0.5: delivered precision, pooled", relevance["precision_at_0.5"], 0.45, False
            ),
            _target(
                "min_relevance 0.8: delivered precision, pooled", relevance["precision_at_0.8"], 0.75, False
            ),
            _target(
                "min_relevance 0.5: delivered precision, worst kind",
                relevance["worst_kind_precision_at_0.5"],
                0.45,
                False,
            ),
            _target(
                "min_relevance 0.8: delivered precision, worst kind",
                relevance["worst_kind_precision_at_0.8"],
                0.75,
                False,
            ),
        ]
        if "worst_kind_query_mae" in relevance:
            out += [
                _target(
                    "per query, top 20: mean absolute gap promised - delivered, worst kind",
                    relevance["worst_kind_query_mae"],
                    0.05,
                    True,
                    why=_why_query_mae(relevance.get("worst_query_kind")),
                ),
                _target(
                    "per query, top 20: share over-promised by > 0.2", relevance["over_promised"], 0.02, True
                ),
            ]
        for t in ("0.5", "0.9"):
            if f"ood_passing_at_{t}" in relevance:
                out.append(
                    _target(
                        f"out-of-domain queries passing any hit at {t}",
                        relevance[f"ood_passing_at_{t}"],
                        0.05,
                        True,
                    )
                )
    rows = _get(s, "train", "rows") or []
    ntxent = next((row for row in rows if row["objective"] == "ntxent"), None)
    for row in rows:
        if row["objective"] == "ntxent":
            continue
        limit = 2.0 if row["objective"] == "smoothap" else 1.3
        out.append(
            _target(
                f"train step {row['objective']} / ntxent",
                row["vs_ntxent_median"],
                limit,
                True,
                "x",
                _why_train(row, ntxent),
            )
        )
    peaks = [row["peak_rss_mb"] for row in _get(s, "train", "rows") or []]
    if peaks:
        out.append(_target("train peak memory, largest objective", max(peaks) / 1024, 8, True, "GiB"))
    out.append(
        _target(
            "COCO-5K-size evaluation incl. PR-AUC",
            (_get(s, "eval", "full_metrics", "median_ms") or 0) / 1e3 or None,
            30,
            True,
            "s",
        )
    )
    cluster = s.get("cluster")
    if cluster is not None:
        out.append(
            _target(
                f"--workers 2: 16-client queries/s / one client, one process "
                f"({cluster['index']['vectors']:,})",
                _get(cluster, "workers_gain", "ratio"),
                1.8,
                False,
                "x",
                _why_workers(cluster),
            )
        )
    return out
