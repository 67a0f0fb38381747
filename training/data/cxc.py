"""Crisscrossed Captions (CxC): extra human similarity judgements for the COCO Karpathy val/test splits.

CxC (Parekh et al. 2020, google-research-datasets/Crisscrossed-Captions, folder ``data/``) rates
pairs on a 0-5 scale (``agg_score`` = mean of the annotators' ratings) in three tables per split:

* ``sits_{split}.csv`` caption-image (``caption,image,agg_score,sampling_method``);
* ``sts_{split}.csv``  caption-caption (``caption1,caption2,agg_score,sampling_method``);
* ``sis_{split}.csv``  image-image (``image1,image2,agg_score,sampling_method``).

Captions are named ``COCO_val2014:sentid:732091`` (the Karpathy ``sentid`` is the integer after the
last ``:``) and images by their COCO file name (the Karpathy ``filename``). ``*_raw.csv`` files with
per-annotator ratings are not read.

**Positive rule** (:func:`cxc_relevance`): an (image, caption) pair of the evaluated split is
relevant when it is an original COCO pair (the caption was written for the image) OR its SITS
``agg_score >= threshold`` (default 3.0; 3.0 itself counts). SITS rows whose image or caption is not
in the split are skipped and counted. The intramodal tables use the same threshold
(:func:`sts_pairs` / :func:`sis_pairs`; t2t also counts the other captions of the same image).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.training.data.errors import DatasetError, read_text
from icr.training.data.karpathy import find_karpathy_json, load_karpathy
from icr.training.evaluation.metrics.relevant_pairs import Relevance

CXC_URL = "https://github.com/google-research-datasets/Crisscrossed-Captions (folder data/)"
CXC_SPLITS: tuple[str, ...] = ("val", "test")
DEFAULT_THRESHOLD = 3.0
MAX_SCORE = 5.0
HEADERS: dict[str, tuple[str, ...]] = {
    "sits": ("caption", "image", "agg_score", "sampling_method"),
    "sts": ("caption1", "caption2", "agg_score", "sampling_method"),
    "sis": ("image1", "image2", "agg_score", "sampling_method"),
}
# What the two id columns of each table hold.
_KINDS: dict[str, tuple[str, str]] = {
    "sits": ("caption", "image"),
    "sts": ("caption", "caption"),
    "sis": ("image", "image"),
}
_CAPTION_ID = re.compile(r"^[^,\s]*:(\d+)$")


@dataclass(frozen=True)
class CxCPairs:
    """One CxC table: ``left[k]``-``right[k]`` rated ``score[k]`` (0-5), sampled by ``method[k]``.

    Caption columns hold Karpathy sentids (int64), image columns COCO file names (str).
    """

    table: str  # "sits" | "sts" | "sis"
    path: Path
    left: np.ndarray  # (n,) int64 sentids (sits, sts) or str file names (sis)
    right: np.ndarray  # (n,) str file names (sits, sis) or int64 sentids (sts)
    score: np.ndarray  # (n,) float64 agg_score
    method: np.ndarray  # (n,) str sampling_method

    def __len__(self) -> int:
        return int(self.score.size)


@dataclass(frozen=True)
class CxC:
    """The three aggregated CxC tables of one split (``val`` or ``test``)."""

    split: str
    directory: Path
    sits: CxCPairs  # caption (sentid) - image (file name)
    sts: CxCPairs  # caption - caption
    sis: CxCPairs  # image - image


def cxc_files(directory: str | Path, split: str) -> dict[str, Path]:
    return {table: Path(directory) / f"{table}_{split}.csv" for table in HEADERS}


def load_cxc(directory: str | Path, split: str = "test") -> CxC:
    """Read ``{sits,sts,sis}_{split}.csv`` from ``directory``; DatasetError naming the file on any problem."""
    if split not in CXC_SPLITS:
        raise ValueError(f"CxC annotates the COCO Karpathy 'val' and 'test' splits only, got split {split!r}")
    directory = Path(directory).expanduser()
    files = cxc_files(directory, split)
    missing = [p for p in files.values() if not p.is_file()]
    if missing:
        raise DatasetError(
            f"CxC file(s) missing: {', '.join(p.name for p in missing)}.",
            path=directory,
            hint=f"Expected {', '.join(p.name for p in files.values())} in this folder; get them from "
            f"{CXC_URL}.",
        )
    tables = {table: _read_table(table, path) for table, path in files.items()}
    return CxC(split=split, directory=directory, **tables)


def _read_table(table: str, path: Path) -> CxCPairs:
    hint = f"Re-download the file from {CXC_URL}."
    text = read_text(path, f"CxC {table.upper()} file", hint)
    rows = csv.reader(io.StringIO(text, newline=""))
    header = next(rows, None)
    expected = HEADERS[table]
    if header is None or tuple(h.strip() for h in header) != expected:
        raise DatasetError(
            f"bad header {','.join(header) if header else '(empty file)'!r}; "
            f"expected {','.join(expected)!r}.",
            path=path,
            line=1,
            hint=hint,
        )
    kinds = _KINDS[table]
    left: list[Any] = []
    right: list[Any] = []
    scores: list[float] = []
    methods: list[str] = []
    for row in rows:
        line = rows.line_num
        if not row or all(not cell.strip() for cell in row):
            continue  # blank line (e.g. at the end of the file)

        def bad(problem: str, line: int = line) -> DatasetError:
            return DatasetError(f"bad CxC row: {problem}.", path=path, line=line, hint=hint)

        if len(row) != len(expected):
            raise bad(f"{len(row)} fields, expected {len(expected)} ({','.join(expected)})")
        ids: list[int | str] = []  # caption ids are sentids, image ids file names
        for kind, cell in zip(kinds, row[:2], strict=True):
            cell = cell.strip()
            if kind == "caption":
                match = _CAPTION_ID.match(cell)
                if not match:
                    raise bad(f"caption id {cell!r} is not of the form COCO_val2014:sentid:N")
                ids.append(int(match.group(1)))
            else:
                if not cell:
                    raise bad("empty image file name")
                ids.append(cell)
        try:
            score = float(row[2])
        except ValueError:
            raise bad(f"agg_score {row[2]!r} is not a number") from None
        if not 0.0 <= score <= MAX_SCORE:  # also rejects NaN
            raise bad(f"agg_score {score} outside [0, {MAX_SCORE:g}]")
        left.append(ids[0])
        right.append(ids[1])
        scores.append(score)
        methods.append(row[3].strip())

    def column(values: list[Any], kind: str) -> np.ndarray:
        return np.asarray(values, dtype=np.int64 if kind == "caption" else object)

    return CxCPairs(
        table=table,
        path=path,
        left=column(left, kinds[0]),
        right=column(right, kinds[1]),
        score=np.asarray(scores, dtype=np.float64),
        method=np.asarray(methods, dtype=object),
    )


# --------------------------------------------------------------------------- relevance


def _index(ids: list[Any], what: str) -> dict[Any, int]:
    index: dict[Any, int] = {}
    for k, v in enumerate(ids):
        if v in index:
            raise ValueError(f"{what} {v!r} occurs twice in the split (rows {index[v]} and {k})")
        index[v] = k
    return index


def _lookup(values: np.ndarray, index: dict[Any, int]) -> np.ndarray:
    """(n,) int64 row of each id in the split, -1 where absent."""
    return np.fromiter((index.get(v, -1) for v in values.tolist()), dtype=np.int64, count=values.size)


def _distribution(counts: np.ndarray) -> dict[str, Any]:
    """Summary of the number of positives per query."""
    counts = np.asarray(counts, dtype=np.int64)
    values, freq = np.unique(counts, return_counts=True)
    return {
        "queries": int(counts.size),
        "min": int(counts.min()) if counts.size else 0,
        "mean": float(counts.mean()) if counts.size else 0.0,
        "median": float(np.median(counts)) if counts.size else 0.0,
        "max": int(counts.max()) if counts.size else 0,
        "histogram": {str(int(v)): int(f) for v, f in zip(values, freq, strict=True)},
    }


def _method_counts(method: np.ndarray) -> dict[str, int]:
    names, counts = np.unique(method.astype(str), return_counts=True)
    return {str(m): int(n) for m, n in zip(names, counts, strict=True)}


def cxc_relevance(
    cxc: CxC,
    image_filenames: list[str],
    caption_sentids: list[int],
    img_of_cap: np.ndarray,
    threshold: float = DEFAULT_THRESHOLD,
) -> tuple[Relevance, dict[str, Any]]:
    """Dense (N_img, N_cap) relevance: original COCO pairs UNION SITS pairs with agg_score >= threshold.

    ``image_filenames[i]`` names image row i, ``caption_sentids[c]`` caption column c, and
    ``img_of_cap[c]`` is the image the caption was written for. SITS rows whose image or caption is
    not in the split are skipped and counted. Returns the relevance and statistics (rows read,
    skipped, above the threshold, positives added, positives per i2t / t2i query).
    """
    img_of_cap = np.asarray(img_of_cap, dtype=np.int64)
    n_img, n_cap = len(image_filenames), len(caption_sentids)
    if img_of_cap.shape != (n_cap,):
        raise ValueError(
            f"img_of_cap must have one entry per caption ({n_cap}), got shape {img_of_cap.shape}"
        )
    relevance = Relevance.annotations(img_of_cap, n_img)
    dense = relevance.image_rows(0, n_img)  # (N_img, N_cap) bool, a fresh array: the original pairs
    annotated = int(dense.sum())

    sits = cxc.sits
    rows = _lookup(sits.right, _index(list(image_filenames), "image file name"))  # (n,)
    cols = _lookup(sits.left, _index([int(s) for s in caption_sentids], "caption sentid"))  # (n,)
    image_out, caption_out = rows < 0, cols < 0
    inside = ~image_out & ~caption_out
    positive = inside & (sits.score >= threshold)
    dense[rows[positive], cols[positive]] = True
    added = int(dense.sum()) - annotated
    original_rows = inside & (rows == np.where(cols >= 0, img_of_cap[np.maximum(cols, 0)], -2))
    stats: dict[str, Any] = {
        "file": str(sits.path),
        "threshold": float(threshold),
        "rule": f"original COCO pairs OR SITS agg_score >= {threshold:g}",
        "sits_rows": len(sits),
        "sits_rows_in_split": int(inside.sum()),
        "sits_rows_skipped": int((~inside).sum()),
        "sits_skipped_image_not_in_split": int((image_out & ~caption_out).sum()),
        "sits_skipped_caption_not_in_split": int((caption_out & ~image_out).sum()),
        "sits_skipped_both_not_in_split": int((image_out & caption_out).sum()),
        "sits_rows_at_or_above_threshold": int(positive.sum()),
        "sits_rows_original_pair": int(original_rows.sum()),
        "sampling_methods": _method_counts(sits.method),
        "annotated_pairs": annotated,
        "positives_added": added,
        "positive_pairs": annotated + added,
        "i2t_positives_per_query": _distribution(dense.sum(axis=1)),
        "t2i_positives_per_query": _distribution(dense.sum(axis=0)),
    }
    return Relevance.matrix(dense), stats


def intramodal_pairs(
    pairs: CxCPairs,
    ids: list[Any],
    threshold: float = DEFAULT_THRESHOLD,
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Positive pairs of an intramodal table (STS: ``ids`` = caption sentids; SIS: image file names).

    Returns ``(P, 2)`` int64 rows into ``ids``, both orders of every undirected pair with
    ``agg_score >= threshold`` (a pair with itself is dropped), and statistics. ``groups`` (t2t: the
    image of each caption) only serves to count how many positives are new beyond "same group".
    """
    key = (lambda v: int(v)) if pairs.table == "sts" else (lambda v: v)
    index = _index([key(v) for v in ids], "caption sentid" if pairs.table == "sts" else "image file name")
    a, b = _lookup(pairs.left, index), _lookup(pairs.right, index)  # (n,)
    inside = (a >= 0) & (b >= 0)
    positive = inside & (pairs.score >= threshold) & (a != b)
    both = np.concatenate([np.stack([a[positive], b[positive]], 1), np.stack([b[positive], a[positive]], 1)])
    both = np.unique(both.reshape(-1, 2), axis=0).astype(np.int64)  # (P, 2) sorted by query
    undirected = both[both[:, 0] < both[:, 1]]
    stats: dict[str, Any] = {
        "file": str(pairs.path),
        "threshold": float(threshold),
        "rows": len(pairs),
        "rows_in_split": int(inside.sum()),
        "rows_skipped_not_in_split": int((~inside).sum()),
        "rows_at_or_above_threshold": int((inside & (pairs.score >= threshold)).sum()),
        "sampling_methods": _method_counts(pairs.method),
        "positive_pairs": int(undirected.shape[0]),
    }
    if groups is not None:
        groups = np.asarray(groups)
        stats["positive_pairs_beyond_same_image"] = int(
            (groups[undirected[:, 0]] != groups[undirected[:, 1]]).sum()
        )
    return both, stats


# --------------------------------------------------------------------------- split identity

# Split names of precomp folders (SCAN / VSRN / VSE-infinity) -> the Karpathy split they hold.
PRECOMP_TO_KARPATHY = {"testall": "test", "test": "test", "dev": "val", "val": "val"}


@dataclass(frozen=True)
class SplitIds:
    """Who is who in an evaluated split: ``filenames[i]`` of image row i, ``sentids[c]`` of caption c."""

    karpathy_json: Path
    karpathy_split: str
    filenames: list[str]
    sentids: list[int]


def find_cxc_karpathy(data_kind: str, source: Path, given: str | Path | None) -> Path:
    """The Karpathy JSON naming the split's images and captions (see :func:`split_ids`)."""
    if given is not None:
        return find_karpathy_json(Path(given).expanduser())
    if data_kind == "karpathy":
        return Path(source)
    folder = Path(source)
    for candidate in (folder, folder.parent):
        if (candidate / "dataset_coco.json").is_file():
            return candidate / "dataset_coco.json"
    raise DatasetError(
        "CxC needs the COCO image file names and caption sentids of the split, which a precomp folder "
        "does not hold; no dataset_coco.json in this folder or its parent.",
        path=folder,
        hint="Pass the Karpathy JSON with --cxc-karpathy PATH/dataset_coco.json "
        "(from Karpathy's caption_datasets.zip).",
    )


def _letters(text: str) -> str:
    """Caption text compared across sources: lower-cased letters and digits only."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def split_ids(
    data_kind: str,
    source: Path,
    split: str,
    captions: list[str],
    img_of_cap: np.ndarray,
    num_images: int,
    karpathy: str | Path | None = None,
    captions_per_image: int = 5,
) -> SplitIds:
    """File names and sentids of an evaluated split, from a Karpathy JSON, checked against the split.

    Karpathy data: its own JSON. Precomp folders carry no ids: their split (``testall`` = Karpathy
    ``test``, ``dev`` = ``val``) is taken as the Karpathy split's images in JSON order with their
    first ``captions_per_image`` sentids (the SCAN/VSRN order). The image count, the caption layout
    and the caption texts (lower-cased letters and digits) must agree, else DatasetError.
    """
    json_path = find_cxc_karpathy(data_kind, source, karpathy)
    name = split if data_kind == "karpathy" else PRECOMP_TO_KARPATHY.get(split)
    if name is None:
        raise ValueError(
            f"CxC covers the COCO Karpathy val and test splits; precomp split {split!r} is neither "
            f"(use testall for test, dev for val)"
        )
    records = load_karpathy(json_path, captions_per_image=captions_per_image, check_images=False).split(name)
    hint = (
        "CxC ids come from the Karpathy JSON: pass the dataset_coco.json this split was built from "
        "(--cxc-karpathy), and evaluate the full split (precomp testall, not the 1K test subset)."
    )
    if len(records) != num_images:
        raise DatasetError(
            f"Karpathy split {name!r} has {len(records):,} images but the evaluated split {split!r} has "
            f"{num_images:,}.",
            path=json_path,
            hint=hint,
        )
    expected = np.arange(len(records) * captions_per_image, dtype=np.int64) // captions_per_image
    if not np.array_equal(np.asarray(img_of_cap), expected):
        raise DatasetError(
            f"the evaluated split does not hold {captions_per_image} captions per image in image order "
            f"({len(captions):,} captions for {num_images:,} images).",
            path=json_path,
            hint=hint,
        )
    karpathy_caps = records.images
    for c, text in enumerate(captions):
        record = karpathy_caps[c // captions_per_image]
        j = c % captions_per_image
        mine = _letters(text)
        if mine != _letters(record.captions[j]) and mine != _letters("".join(record.tokens[j])):
            raise DatasetError(
                f"caption {c} of the evaluated split ({text!r}) differs from caption {j} of image "
                f"{record.filename} (sentid {record.sentids[j]}) in Karpathy split {name!r} "
                f"({record.captions[j]!r}).",
                path=json_path,
                hint=hint,
            )
    return SplitIds(
        karpathy_json=json_path,
        karpathy_split=name,
        filenames=[r.filename for r in records.images],
        sentids=[s for r in records.images for s in r.sentids],
    )
