"""One benchmark job, run by :class:`service.jobs.JobRunner` in its own process.

``python -m service.benchmark_worker --db JOBS --job ID --attempt N --checkpoint C --data D``
evaluates the checkpoint on the dataset with the job's split, protocol and distractors, writing
progress, then the headline metrics and the whole report, into the job database. It dies with
the server (Linux parent-death signal) and writes nothing once its job is no longer its own.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys
from pathlib import Path
from typing import Any

from service.jobs import JobStore

HEADLINE = ("rsum", "i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "i2t_map10", "t2i_rprec")


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the server dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers a job list shows: retrieval metrics and global PR-AUC per label set."""
    out: dict[str, Any] = {}
    for labels in ("annotations", "ground_truth"):
        section = report.get(labels)
        if not section:
            continue
        retrieval = section.get("retrieval", {})
        picked = {key: retrieval[key] for key in HEADLINE if key in retrieval}
        glob = section.get("global", {})
        picked.update({key: glob[key] for key in ("pr_auc", "best_f1") if key in glob})
        out[labels] = picked
    if "distractors" in report:
        out["distractors"] = report["distractors"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--db", "--job", "--checkpoint", "--data"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    _die_with_parent()
    store = JobStore(args.db)
    job = store.get(args.job, with_report=False)
    if job is None or job["status"] != "running":
        return 0  # not ours any more (interrupted meanwhile): nothing to do

    def progress(stage: str, fraction: float) -> None:
        if not store.set_progress(args.job, args.attempt, fraction, stage):
            raise SystemExit(0)  # the job was interrupted or taken over: stop working on it

    try:
        from training.evaluate_checkpoint import EvalOptions, evaluate_checkpoint

        progress("loading checkpoint", 0.0)
        options = EvalOptions(
            split=job["split"],
            protocol=job["protocol"],
            distractors=job["distractors"],
            device=args.device,
            progress=False,
            on_stage=progress,
        )
        report = evaluate_checkpoint(Path(args.checkpoint), Path(args.data), options)
    except (ValueError, FileNotFoundError, KeyError) as err:  # the data or the request do not fit
        store.fail(args.job, args.attempt, f"{type(err).__name__}: {err}")
        return 1
    store.succeed(args.job, args.attempt, headline(report), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
