"""``icr bench``: the performance suite, its targets checked, one JSON + Markdown report per run.

Sections (``--only`` picks some): ``build`` (index build of the largest gallery), ``search``
(in-process figures per gallery size), ``http`` (``icr serve`` under 1/4/16 clients, ANN and
exact), ``cluster`` (the largest gallery served as one process, as ``--workers 2`` and as Ray
shards through HTTP, and the coordinator's own cost), ``peers`` (the largest gallery's ANN index
beside FAISS HNSW, hnswlib and usearch at k = 10 and at the service's depth), ``relevance``
(threshold honesty of the largest served index: what ``min_relevance`` delivers per query kind
on held-out captions), ``writes`` (a living index: upserts per second, log replay, search while
writers run), ``train`` (step time and peak memory per objective), ``eval`` (COCO-5K-size
metrics) and ``gpu`` (when a CUDA GPU is visible).
``--quick`` runs every section small (CI-sized: a 20,000 distractor gallery, a model trained for
one short epoch, few repeats); its figures check that the suite works, not the targets.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from icr.core.cli_support import fail_cleanly

SECTIONS = (
    "build",
    "search",
    "http",
    "peers",
    "filters",
    "scale",
    "cluster",
    "relevance",
    "writes",
    "train",
    "eval",
    "gpu",
)


def _log(text: str) -> None:
    typer.echo(f"[bench {time.strftime('%H:%M:%S')}] {text}", err=True)


@fail_cleanly
def bench_command(
    quick: Annotated[bool, typer.Option(help="Every section, small and fast (CI smoke run).")] = False,
    only: Annotated[
        str, typer.Option(help=f"Comma-separated sections to run, of: {', '.join(SECTIONS)}.")
    ] = ",".join(SECTIONS),
    sizes: Annotated[
        str,
        typer.Option(
            help="Distractor counts of the searched galleries (default 100000,1000000; quick 20000)."
        ),
    ] = "",
    workdir: Annotated[
        Path, typer.Option(help="Cache of data, model, embeddings and indices (reused by the next run).")
    ] = Path("bench-work"),
    out: Annotated[Path, typer.Option(help="Where the JSON and Markdown reports go.")] = Path(
        "bench/results"
    ),
    checkpoint: Annotated[
        Path | None, typer.Option(help="Model to benchmark (default: the demo model shipped with icr).")
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="Its synthetic benchmark folder (with --checkpoint).")
    ] = None,
    scale_vectors: Annotated[
        Path | None,
        typer.Option(
            help="(N, D) float32 .npy for the scale section's on-disk index, indexed as it is (e.g. from "
            "python -m bench.rendered_vectors); default: 10M vectors resampled from the gallery's."
        ),
    ] = None,
    scale_queries: Annotated[
        Path | None, typer.Option(help="(Q, D) float32 .npy of its queries (with --scale-vectors).")
    ] = None,
) -> None:
    """Measure search latency/throughput (in-process and HTTP), index build, training step time per
    objective and evaluation speed, each next to the target or the alternative it is compared with.

    Examples (--quick: every section small, a few minutes; no option: the full CPU suite, about an
    hour, cached artifacts reused):

      icr bench --quick

      icr bench

      icr bench --only search,http --sizes 100000

      icr bench --checkpoint runs/mine/best --data data/synth --workdir bench-mine

      icr bench --only scale --scale-vectors base10m.npy --scale-queries queries.npy
    """
    from bench import evaluation, gallery, search_http, search_inprocess, threshold_honesty, training
    from bench import floors as floor_mod

    chosen = [s.strip() for s in only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise ValueError(f"--only: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    scale_files = _scale_files(scale_vectors, scale_queries)
    counts = [int(x) for x in sizes.split(",") if x] or ([20_000] if quick else [100_000, 1_000_000])
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "format": "icr-bench",
        "version": 1,
        "host": socket.gethostname(),
        "date": dt.date.today().isoformat(),
        "quick": quick,
        "command": "icr bench " + " ".join(sys.argv[2:]),
        "machine": _machine(),
        "sections": {},
    }
    sections = report["sections"]
    needs_gallery = (set(SECTIONS) - {"writes", "train", "eval"}) & set(chosen)  # all search a gallery
    needs_model = needs_gallery or "train" in chosen
    model = gallery.prepare_model(workdir, quick, checkpoint, data, _log) if needs_model else None
    largest = max(counts)
    if needs_gallery:
        assert model is not None
        ann_dirs: dict[int, Path] = {largest: workdir / f"index-{largest}"}
        built = gallery.build_largest(model, largest, ann_dirs[largest], _log, quiet=quick)
        if "build" in chosen:
            sections["build"] = built
        embeddings = gallery.distractor_embeddings(ann_dirs[largest], workdir / f"distractors-{largest}.npy")
        exact_dirs = {
            n: gallery.gallery_index(model, embeddings, n, "Flat", workdir / f"exact-{n}", _log)
            for n in counts
        }
        for n in counts:
            if n != largest:
                ann_dirs[n] = gallery.gallery_index(
                    model, embeddings, n, "auto", workdir / f"index-{n}", _log
                )
        captions = _captions(model.data)
    if "search" in chosen or "http" in chosen:
        _log("floors: memory bandwidth and matmul rate")
        import numpy as np

        matrix = np.load(embeddings, mmap_mode="r")[:largest]
        matrix = np.ascontiguousarray(matrix)
        sections["floors"] = {
            "bandwidth": floor_mod.bandwidth(matrix, repeats=3 if quick else 7),
            "matmul": floor_mod.matmul_rate(2048 if quick else 4096),
        }
        del matrix
    if "search" in chosen:
        sections["search"] = {
            str(n): search_inprocess.run(
                model.checkpoint,
                ann_dirs[n],
                exact_dirs[n],
                captions[: 100 if quick else 1000],
                sections["floors"],
                exact_queries=10 if quick else 100,
                log=_log,
            )
            for n in counts
        }
    if "http" in chosen:
        sections["http"] = {
            str(n): search_http.run(
                model.checkpoint,
                {"ann": ann_dirs[n], "exact": exact_dirs[n]},
                captions,
                {"ann": 30 if quick else 300, "exact": 5 if quick else 40},
                workdir,
                _log,
            )
            for n in counts
        }
    if {"peers", "filters", "scale", "cluster"} & set(chosen):
        assert model is not None
        sections.update(
            _largest_gallery_sections(
                chosen,
                model,
                ann_dirs[largest],
                exact_dirs[largest],
                embeddings,
                captions,
                workdir,
                quick,
                scale_files,
            )
        )
    if "relevance" in chosen:
        sections["relevance"] = threshold_honesty.run(ann_dirs[largest], _log)
    if "train" in chosen:
        assert model is not None
        sections["train"] = training.run(
            model.data,
            batch=128,
            steps=2 if quick else 15,
            warmup=1 if quick else 3,
            rounds=1 if quick else 3,
            only=training.QUICK_OBJECTIVES if quick else None,
            log=_log,
        )
    if "writes" in chosen:
        sections["writes"] = _writes_section(model, ann_dirs[largest] if needs_gallery else None, quick)
    if "eval" in chosen:
        sections["eval"] = evaluation.run(1000 if quick else 5000, 1 if quick else 3, _log)
    if "gpu" in chosen:
        sections["gpu"] = _gpu_section(model, ann_dirs[largest], exact_dirs[largest], workdir, quick)
    report["seconds"] = time.perf_counter() - started
    from bench.report import markdown
    from bench.targets import targets

    report["targets"] = targets(report)
    text = markdown(report)
    json_path, md_path = _write(report, text, out)
    typer.echo(text)
    typer.echo(f"wrote {json_path} and {md_path}")


def _scale_files(vectors: Path | None, queries: Path | None) -> tuple[Path, Path] | None:
    """``--scale-vectors`` and ``--scale-queries``, both given and both files, or neither."""
    if vectors is None or queries is None:
        if vectors is not None or queries is not None:
            raise ValueError("--scale-vectors and --scale-queries go together: give both or neither")
        return None
    for given in (vectors, queries):
        if not given.is_file():
            raise ValueError(f"{given}: no such file (a .npy from python -m bench.rendered_vectors)")
    return vectors.resolve(), queries.resolve()


def _writes_section(model: Any, index: Path | None, quick: bool) -> dict[str, Any]:
    """The ``writes`` section; uploads too where the bench built a gallery (a checkpoint and an index)."""
    from bench import writes

    section = writes.run(
        100_000 if quick else 1_000_000, 10_000 if quick else 100_000, 200 if quick else 1000, _log
    )
    if index is not None:
        photos = sorted(Path(model.data).rglob("*.png"))[: 40 if quick else 400]
        section["uploads"] = writes.uploads(index, model.checkpoint, photos, _log)
    return section


def _gpu_section(model: Any, ann_dir: Path, exact_dir: Path, workdir: Path, quick: bool) -> dict[str, Any]:
    """The ``gpu`` section over the largest gallery (said not run, and why, without a CUDA GPU)."""
    from bench import gpu as gpu_mod
    from bench import training
    from icr.index.index_folder import load_index_dir

    ok, why = gpu_mod.available()
    section: dict[str, Any] = {"ran": ok, "device": why}
    if not ok:
        return section
    ann, _, meta = load_index_dir(ann_dir)
    meta.close()
    flat, _, meta = load_index_dir(exact_dir)
    meta.close()
    # the exact twin's vectors: the test images, then the distractors, in the ANN index's id order
    vectors = flat.reconstruct_n(0, flat.ntotal)  # (N, D)
    section["search"] = gpu_mod.search(vectors, vectors[:1024], ann, 5 if quick else 20)
    section["train"] = training.run(
        model.data,
        batch=128,
        steps=2 if quick else 15,
        warmup=1 if quick else 3,
        rounds=1,
        only=training.QUICK_OBJECTIVES if quick else None,
        log=_log,
        config="f30k-vsepp-resnet50",
        overrides=(f'model.image.path="{gpu_mod.resnet_folder(workdir)}"', 'train.device="cuda"'),
    )
    return section


def _largest_gallery_sections(
    chosen: list[str],
    model: Any,
    index_dir: Path,
    exact_dir: Path,
    embeddings: Path,
    captions: list[str],
    workdir: Path,
    quick: bool,
    scale_vectors: tuple[Path, Path] | None,
) -> dict[str, Any]:
    """The ``peers``, ``filters``, ``scale`` and ``cluster`` sections of the largest gallery (each
    only when chosen)."""
    out: dict[str, Any] = {}
    checkpoint = model.checkpoint
    if "peers" in chosen:
        from bench import ann_peers

        out["peers"] = ann_peers.run_dirs(
            index_dir, exact_dir, checkpoint, model.data, 100 if quick else 300, 1000, _log
        )
    if "filters" in chosen:
        from bench import filters

        out["filters"] = {
            "select": filters.select(workdir, 100_000 if quick else 1_000_000, _log),
            "search": filters.search(checkpoint, index_dir, captions[: 100 if quick else 500], 1000, _log),
        }
    if "scale" in chosen:
        from bench import scale

        out["scale"] = scale.run(checkpoint, embeddings, workdir, quick, _log, scale_vectors)
    if "cluster" in chosen:
        from bench import cluster

        out["cluster"] = cluster.run(index_dir, checkpoint, captions, workdir / "cluster", quick, _log)
    return out


def _captions(data: Path) -> list[str]:
    from icr.training.data.training_data import open_split

    return open_split(data, "test").captions


def _machine() -> dict[str, Any]:
    import faiss
    import numpy as np
    import torch

    model = ""
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "faiss": faiss.__version__,
        "numpy": np.__version__,
    }


def _write(report: dict[str, Any], text: str, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['host']}-{report['date']}" + ("-quick" if report["quick"] else "")
    paths = out / f"{stem}.json", out / f"{stem}.md"
    for path, content in zip(paths, (json.dumps(report, indent=1) + "\n", text), strict=True):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(content)
        tmp.replace(path)
    return paths
