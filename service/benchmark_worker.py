"""One benchmark job, run by :class:`service.jobs.JobRunner` in its own process.

``python -m icr.service.benchmark_worker --db JOBS --job ID --attempt N --checkpoint C --data D``
evaluates the checkpoint on the dataset with the job's split, protocol and distractors, writing
progress, then the headline metrics and the whole report, into the job database. It lowers its
own priority, dies with the server (Linux parent-death signal) and writes nothing once its job is
no longer its own (every write names the attempt; see :mod:`service.jobs`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from icr.core.devices import DEVICES
from icr.service.jobs import JobStore
from icr.training.evaluation.full_report import EvalOptions, evaluate_checkpoint

HEADLINE = ("rsum", "i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "i2t_map10", "t2i_rprec")
GLOBAL = ("pr_auc", "best_f1", "best_f1_threshold")
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGTERM this process when the thread that started it ends (no-op elsewhere);
    exit at once when that parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(0)  # the server died before the signal was armed


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers a job list shows, per label set (annotations, and the generator's ground truth
    on the embedded benchmark): retrieval recalls, global PR-AUC and best F1, calibration ECE."""
    out: dict[str, Any] = {}
    for labels in ("annotations", "ground_truth"):
        section = report.get(labels)
        if not section:
            continue
        retrieval = section.get("retrieval", {})
        picked = {key: retrieval[key] for key in HEADLINE if key in retrieval}
        glob = section.get("global", {})
        picked.update({key: glob[key] for key in GLOBAL if key in glob})
        calibration = section.get("calibration")
        if isinstance(calibration, dict) and "ece" in calibration:
            picked["ece"] = calibration["ece"]
        out[labels] = picked
    if "distractors" in report:
        out["distractors"] = {
            key: value
            for key, value in report["distractors"].items()
            if key in ("count", "annotations", "ground_truth")
        }
    return out


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for flag in ("--db", "--job", "--checkpoint", "--data"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--nice", type=int, default=10, help="Priority increment (search comes first).")
    parser.add_argument("--parent-pid", type=int, default=None, help="Exit if this is not the parent.")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    store = JobStore(args.db)
    job = store.get(args.job, with_report=False)
    if job is None or job.status != "running":
        return 0  # not ours any more (interrupted meanwhile): nothing to do

    def progress(stage: str, fraction: float) -> None:
        if not store.set_progress(args.job, args.attempt, fraction, stage):
            raise SystemExit(0)  # the job was interrupted or taken over: stop working on it

    try:
        progress("loading checkpoint", 0.0)

        options = EvalOptions(
            split=job.split,
            protocol=job.protocol,
            distractors=job.distractors,
            device=args.device,
            progress=False,
            on_stage=progress,
        )
        report = evaluate_checkpoint(Path(args.checkpoint), Path(args.data), options)
        progress("saving the report", 0.99)
        store.succeed(args.job, args.attempt, headline(report), report)
    except Exception as err:  # the data, the checkpoint or the request do not fit: say which, in one line
        traceback.print_exc()  # the runner logs the whole story
        # the dataset's folder by its name, the checkpoint's as "checkpoint" (clients read this)
        roots = {job.dataset: args.data, "checkpoint": args.checkpoint}
        store.fail(args.job, args.attempt, _one_line(err), roots)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
