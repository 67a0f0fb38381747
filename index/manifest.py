"""``manifest.json``: what an index directory holds, what built it, and how well it searches.

The manifest is the index's identity card: the service checks it against the checkpoint it loads
(sha256, dim, metric) and refuses a mismatch with the command that rebuilds the index.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT = "icr-index"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
METRIC = "inner_product"  # on L2-normalised vectors: cosine similarity
MODALITIES = ("image", "text")
# The checkpoint's name for the same metric (its embeddings are normalised for cosine scoring).
COMPATIBLE_CHECKPOINT_METRICS = ("cosine", METRIC)


@dataclass
class Manifest:
    """Fields of ``manifest.json`` (format ``icr-index``, version 1).

    ``modality``: what the index holds (``image`` for text->image search, ``text`` for captions,
    image->text). ``recall_check``: ``{k, recall, queries, nprobe}``, ANN recall@k against exact
    search on held-out queries. ``peak_rss_mb``: the building process's peak resident memory.
    ``data``: ``{path, split}`` plus where distractors came from.
    """

    modality: str
    checkpoint_sha256: str
    checkpoint_path: str
    dim: int
    factory: str
    factory_reason: str
    ntotal: int
    gallery_count: int
    distractor_count: int
    recall_check: dict[str, Any]
    build_seconds: float
    peak_rss_mb: float
    created: str
    data: dict[str, Any]
    built_on: str = "cpu"  # cpu | gpu: where FAISS trained and filled the index
    metric: str = METRIC
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # free-form build details (not validated)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # format first: a reader sees what the file is before anything else
        return {"format": d.pop("format"), "format_version": d.pop("format_version"), **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, d: Any, source: str = MANIFEST_FILE) -> Manifest:
        """Validated manifest; ValueError naming ``source`` and the bad field. Unknown keys are ignored."""
        hint = "Rebuild the index with `icr index build`."
        if not isinstance(d, dict):
            raise ValueError(f"{source}: an index manifest is a JSON object. {hint}")
        if d.get("format") != FORMAT:
            raise ValueError(f"{source}: not an icr index manifest (format is not {FORMAT!r}). {hint}")
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{source}: index format_version {d.get('format_version')!r}, this code reads version "
                f"{FORMAT_VERSION}. {hint}"
            )
        names = [f.name for f in fields(cls)]
        optional = {"built_on", "extra"}
        missing = [n for n in names if n not in d and n not in optional]
        if missing:
            raise ValueError(f"{source}: manifest lacks {missing}. {hint}")
        m = cls(**{n: d[n] for n in names if n in d})
        problems = m._problems()
        if problems:
            raise ValueError(f"{source}: invalid manifest: {'; '.join(problems)}. {hint}")
        return m

    def _problems(self) -> list[str]:
        p = []
        if self.modality not in MODALITIES:
            p.append(f"modality {self.modality!r} is not one of {MODALITIES}")
        if self.metric != METRIC:
            p.append(f"metric {self.metric!r}, expected {METRIC!r}")
        for name in ("dim", "ntotal", "gallery_count", "distractor_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                p.append(f"{name} must be a non-negative integer, got {value!r}")
        if not p and self.dim < 1:
            p.append("dim must be >= 1")
        if not p and self.gallery_count + self.distractor_count != self.ntotal:
            p.append(
                f"gallery_count {self.gallery_count} + distractor_count {self.distractor_count} "
                f"!= ntotal {self.ntotal}"
            )
        for name in ("checkpoint_sha256", "checkpoint_path", "factory", "factory_reason", "created"):
            if not isinstance(getattr(self, name), str):
                p.append(f"{name} must be a string")
        for name in ("build_seconds", "peak_rss_mb"):
            if not isinstance(getattr(self, name), int | float):
                p.append(f"{name} must be a number")
        check = self.recall_check
        if not isinstance(check, dict) or not {"k", "recall", "queries"} <= set(check):
            p.append("recall_check must be an object with k, recall and queries")
        if not isinstance(self.data, dict) or not {"path", "split"} <= set(self.data):
            p.append("data must be an object with path and split")
        if self.built_on not in ("cpu", "gpu"):
            p.append(f"built_on {self.built_on!r} is not cpu or gpu")
        if not isinstance(self.extra, dict):
            p.append("extra must be an object")
        return p

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Manifest:
        """Read and validate a manifest file (or the one in an index directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / MANIFEST_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path}: index manifest not found; is this an index directory written by `icr index build`?"
            ) from None
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read the index manifest ({err})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{err.lineno}:{err.colno}: index manifest is not valid JSON ({err.msg}); "
                "rebuild the index with `icr index build`"
            ) from None
        return cls.from_dict(data, source=str(path))

    def rebuild_command(
        self,
        index_dir: str | os.PathLike[str] | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> str:
        """The `icr index build` command line that rebuilds this index (for another checkpoint)."""
        parts = [
            "icr index build",
            f"--checkpoint {checkpoint if checkpoint is not None else 'C'}",
            f"--data {self.data.get('path', 'D')}",
            f"--split {self.data.get('split', 'test')}",
        ]
        if self.modality != "image":
            parts.append(f"--modality {self.modality}")
        source = self.data.get("distractor_source")
        if self.distractor_count and source == "generator":
            parts.append(f"--distractors {self.distractor_count}")
        elif self.distractor_count and source:
            parts.append(f"--distractor-embeddings {source}")
        parts.append(f"--out {index_dir if index_dir is not None else 'DIR'}")
        return " ".join(parts)


def check_compatible(
    manifest: Manifest,
    checkpoint: dict[str, Any] | str,
    dim: int | None = None,
    *,
    index_dir: str | os.PathLike[str] | None = None,
    checkpoint_path: str | os.PathLike[str] | None = None,
) -> None:
    """Raise ValueError unless the index was built from this checkpoint (sha256, dim, metric).

    ``checkpoint`` is the checkpoint's ``config.json`` (as from ``load_checkpoint``) or its weights'
    sha256; ``dim`` defaults to the config's ``embed_dim``. The message names every mismatch and
    the command that rebuilds the index (`icr index build --checkpoint C --data D --out DIR`).
    """
    if isinstance(checkpoint, dict):
        sha = str(checkpoint.get("weights_sha256"))
        dim = int(checkpoint["embed_dim"]) if dim is None and "embed_dim" in checkpoint else dim
        metric = checkpoint.get("metric")
    else:
        sha, metric = str(checkpoint), None
    problems = []
    if sha != manifest.checkpoint_sha256:
        problems.append(
            f"it was built from checkpoint sha256 {manifest.checkpoint_sha256[:12]}... "
            f"({manifest.checkpoint_path}), the checkpoint in use has {sha[:12]}..."
        )
    if dim is not None and int(dim) != manifest.dim:
        problems.append(f"its vectors have dim {manifest.dim}, the model embeds in dim {dim}")
    if metric is not None and metric not in COMPATIBLE_CHECKPOINT_METRICS:
        problems.append(f"it scores by {manifest.metric}, the checkpoint's metric is {metric!r}")
    if problems:
        where = f"index {index_dir}" if index_dir is not None else "the index"
        raise ValueError(
            f"{where} does not match the checkpoint: {'; '.join(problems)}. Rebuild the index for this "
            f"checkpoint with `{manifest.rebuild_command(index_dir, checkpoint_path)}`"
        )
