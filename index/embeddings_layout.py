"""Embeddings in and out, in clip-retrieval's folder layout (``icr embed``, ``--embeddings``).

A folder ``E`` holds, per shard ``i`` (``shard_size`` images each, the last one shorter)::

    img_emb/img_emb_{i}.npy            (r, D) float32, L2-normalised image embeddings
    text_emb/text_emb_{i}.npy          (r, D) float32 of each image's first caption (when every
                                       image has one, as in clip-retrieval's one-caption-per-sample)
    metadata/metadata_{i}.parquet      r rows: image_path, caption, captions and the user's fields
    embeddings_manifest.json           the checkpoint's sha256, dim, source, shards written so far
                                       (and the engine, local or ray, of the run and of each shard)

Row ``j`` of the three files of a shard describe the same image. Each shard's files are written
atomically and the shard is recorded in the manifest only after them, so a killed run resumes at
the first shard not recorded. ``index build --embeddings E`` refuses a folder whose manifest names
another checkpoint; a folder without a manifest (written by clip-retrieval) is accepted only as
distractors (``--distractor-embeddings``), where no checkpoint can be checked.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.core.atomic import atomic_write, atomic_write_text

MANIFEST = "embeddings_manifest.json"
FORMAT = "icr-embeddings"
FORMAT_VERSION = 1
IMG_DIR, TEXT_DIR, META_DIR = "img_emb", "text_emb", "metadata"
RESERVED_COLUMNS = ("image_path", "caption", "captions")
DEFAULT_SHARD_SIZE = 100_000


def row_parts(meta: dict[str, Any]) -> tuple[str, list[str], dict[str, Any]]:
    """(image path, captions, the user's fields) of one metadata row as ``icr embed`` writes it."""
    captions = meta.get("captions") or ([meta["caption"]] if meta.get("caption") else [])
    fields = {k: v for k, v in meta.items() if k not in RESERVED_COLUMNS}
    return str(meta["image_path"]), list(captions), fields


# fp16 embeddings (clip-retrieval's default) round norms to about 1e-3
NORM_TOL = 1e-2


def shard_paths(root: Path, i: int) -> tuple[Path, Path, Path]:
    """(image embeddings, text embeddings, metadata) files of shard ``i``."""
    return (
        root / IMG_DIR / f"img_emb_{i}.npy",
        root / TEXT_DIR / f"text_emb_{i}.npy",
        root / META_DIR / f"metadata_{i}.parquet",
    )


@dataclass
class Shard:
    index: int
    rows: int
    image_embeddings: Path
    text_embeddings: Path | None
    metadata: Path | None


@dataclass
class EmbeddingsFolder:
    """An embeddings folder as read back: its manifest (None for a foreign folder) and shards."""

    root: Path
    manifest: dict[str, Any] | None
    shards: list[Shard]
    dim: int

    @property
    def count(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def has_text(self) -> bool:
        return bool(self.shards) and all(s.text_embeddings is not None for s in self.shards)

    def check_checkpoint(self, sha256: str, checkpoint: str | os.PathLike[str]) -> None:
        """ValueError unless these embeddings were written by the checkpoint with ``sha256``."""
        if self.manifest is None:
            raise ValueError(
                f"{self.root}: no {MANIFEST}, so nothing says which model wrote these embeddings; an "
                f"index gallery must come from the checkpoint that encodes the queries: run `icr embed "
                f"--checkpoint {checkpoint} ... --out {self.root}` (foreign embeddings can still be "
                "distractors: --distractor-embeddings)"
            )
        written = str(self.manifest.get("checkpoint_sha256"))
        if written != sha256:
            raise ValueError(
                f"{self.root}: embeddings of checkpoint sha256 {written[:12]}... "
                f"({self.manifest.get('checkpoint_path')}), not of {checkpoint} ({sha256[:12]}...): queries "
                f"encoded by one model cannot search the other's vectors. Re-embed with `icr embed "
                f"--checkpoint {checkpoint} ... --out NEW_DIR`"
            )

    def chunks(self, with_text: bool = False) -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        """Per shard: ((r, D) float32 checked unit rows, r metadata rows); ``with_text``: the text
        embeddings instead of the image ones."""
        for shard in self.shards:
            path = shard.text_embeddings if with_text else shard.image_embeddings
            assert path is not None
            vectors = load_unit_rows(path, self.dim)  # (r, D)
            rows = read_rows(shard.metadata) if shard.metadata is not None else [{}] * len(vectors)
            if len(rows) != len(vectors):
                raise ValueError(
                    f"{shard.metadata}: {len(rows)} rows for the {len(vectors)} embeddings of {path}; "
                    "a shard's files must be written together (re-run icr embed)"
                )
            yield vectors, rows

    def sample(self, n: int, seed: int, with_text: bool) -> np.ndarray:
        """(<=n, D) rows drawn without replacement across the shards (recall-check queries)."""
        rng = np.random.default_rng(seed)
        pick = np.sort(rng.choice(self.count, min(n, self.count), replace=False))
        out, lo = [], 0
        for shard in self.shards:
            mine = pick[(pick >= lo) & (pick < lo + shard.rows)] - lo
            if len(mine):
                path = shard.text_embeddings if with_text else shard.image_embeddings
                assert path is not None
                out.append(np.asarray(np.load(path, mmap_mode="r")[mine], np.float32))
            lo += shard.rows
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)


def load_unit_rows(path: Path, dim: int) -> np.ndarray:
    """(r, ``dim``) float32 of an .npy of L2-normalised rows (float16 accepted and renormalised)."""
    try:
        emb = np.load(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read embeddings ({err})") from None
    if emb.ndim != 2 or emb.shape[1] != dim or not np.issubdtype(emb.dtype, np.floating):
        raise ValueError(
            f"{path}: expected a float (r, {dim}) array to match the model, got {emb.dtype} {emb.shape}"
        )
    out = np.asarray(emb, np.float32)
    norms = np.linalg.norm(out, axis=1)  # (r,)
    bad = np.flatnonzero(np.abs(norms - 1) > NORM_TOL)
    if len(bad):
        raise ValueError(
            f"{path}: row {int(bad[0])} has norm {norms[bad[0]]:.4f}; embeddings must be L2-normalised"
        )
    return np.ascontiguousarray(out / norms[:, None], dtype=np.float32)


def read_rows(path: Path) -> list[dict[str, Any]]:
    from pyarrow import ArrowInvalid, parquet  # noqa: PLC0415 (pyarrow: only the embeddings and metadata-file paths need it)

    try:
        rows: list[dict[str, Any]] = parquet.read_table(path).to_pylist()
    except (ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: cannot read this metadata shard ({err})") from None
    return rows


def open_embeddings_folder(root: str | os.PathLike[str], dim: int) -> EmbeddingsFolder:
    """Read the layout at ``root`` (written by ``icr embed`` or clip-retrieval); errors name files."""
    root = Path(root)
    if not (root / IMG_DIR).is_dir():
        raise FileNotFoundError(
            f"{root}: not an embeddings folder (no {IMG_DIR}/); write one with `icr embed --checkpoint C "
            f"--images DIR --out {root}`"
        )
    manifest = read_manifest(root)
    if manifest is not None:
        if not manifest.get("complete"):
            raise ValueError(
                f"{root}: unfinished `icr embed` run ({len(manifest.get('shards', []))} of "
                f"{manifest.get('num_shards')} shards); run the same command again to finish it"
            )
        if int(manifest.get("dim", -1)) != dim:
            raise ValueError(
                f"{root}: embeddings of dim {manifest.get('dim')}, the model embeds in dim {dim}"
            )
        numbers = [int(s["index"]) for s in manifest["shards"]]
    else:
        numbers = sorted(
            int(m.group(1))
            for p in (root / IMG_DIR).iterdir()
            if (m := re.fullmatch(r"img_emb_(\d+)\.npy", p.name))
        )
        if not numbers:
            raise ValueError(f"{root / IMG_DIR}: no img_emb_{{i}}.npy files")
    shards = []
    for i in numbers:
        img, text, meta = shard_paths(root, i)
        if not img.is_file():
            raise FileNotFoundError(f"{img}: missing; the embeddings folder is incomplete")
        rows = int(np.load(img, mmap_mode="r").shape[0])
        shards.append(Shard(i, rows, img, text if text.is_file() else None, meta if meta.is_file() else None))
    return EmbeddingsFolder(root, manifest, shards, dim)


def read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err}); remove the folder and run icr embed again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not an {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {manifest.get('format_version')!r}, this code reads {FORMAT_VERSION}"
        )
    return manifest


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def write_shard(
    root: Path,
    i: int,
    image_embeddings: np.ndarray,
    text_embeddings: np.ndarray | None,
    rows: list[dict[str, Any]],
) -> None:
    """Write shard ``i``'s files, each atomically (the manifest records the shard afterwards)."""
    import pyarrow as pa  # noqa: PLC0415 (pyarrow: only the embeddings and metadata-file paths need it)
    from pyarrow import parquet  # noqa: PLC0415 (pyarrow: only the embeddings and metadata-file paths need it)

    img, text, meta = shard_paths(root, i)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(
            f"metadata of shard {i}: a field holds values of different types in different rows ({err}); "
            "give each field one type in the metadata file"
        ) from None
    atomic_write(img, lambda h: np.save(h, np.ascontiguousarray(image_embeddings, np.float32)))
    if text_embeddings is not None:
        atomic_write(text, lambda h: np.save(h, np.ascontiguousarray(text_embeddings, np.float32)))
    atomic_write(meta, lambda h: parquet.write_table(table, h))
