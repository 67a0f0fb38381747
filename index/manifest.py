"""``manifest.json``: what an index directory holds, what built it, and how well it searches.

The manifest is the index's identity card: the service checks it against the checkpoint it loads
(sha256, dim, metric) and refuses a mismatch with the command that rebuilds the index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from icr.core.contracts import field_errors, validated

if TYPE_CHECKING:  # the annotation only: reading a manifest must not load torch
    from icr.training.checkpoint import CheckpointMeta

FORMAT: Final = "icr-index"
FORMAT_VERSION: Final = 1
MANIFEST_FILE = "manifest.json"
METRIC: Final = "inner_product"  # on L2-normalised vectors: cosine similarity
Modality = Literal["image", "text"]
# The kinds of JSON value a metadata field can hold (index.metadata.JSON_KINDS).
FieldKind = Literal["string", "integer", "number", "boolean", "array", "object"]
MODALITIES: tuple[Modality, ...] = ("image", "text")
# The checkpoint's name for the same metric (its embeddings are normalised for cosine scoring).
COMPATIBLE_CHECKPOINT_METRICS = ("cosine", METRIC)


class _RecallCheck(BaseModel):
    """``recall_check``: ANN recall@k against exact search on held-out queries (and the tuned nprobe)."""

    model_config = ConfigDict(strict=True, extra="allow")
    k: int = Field(ge=1)
    recall: float | None
    queries: int = Field(ge=0)
    nprobe: int | None = None


class _DataSource(BaseModel):
    """``data``: the dataset folder and split the gallery came from, plus where distractors came from."""

    model_config = ConfigDict(strict=True, extra="allow")
    path: str
    split: str


def _checked(model: type[BaseModel], value: dict[str, Any]) -> dict[str, Any]:
    """``value`` unchanged if ``model`` accepts it; else one ValueError listing the bad keys."""
    try:
        model.model_validate(value)
    except ValidationError as err:
        raise ValueError(field_errors(err.errors())) from None
    return value


class Manifest(BaseModel):
    """Fields of ``manifest.json`` (format ``icr-index``, version 1), validated on read.

    ``modality``: what the index holds (``image`` for text->image search, ``text`` for captions,
    image->text). ``recall_check``: ``{k, recall, queries, nprobe}``, ANN recall@k against exact
    search on held-out queries. ``peak_rss_mb``: the building process's peak resident memory.
    ``data``: ``{path, split}`` plus where distractors came from. ``recall_check`` and ``data`` stay
    plain dicts for their readers; their required keys are checked by the models above.
    """

    # strict: a count written as 3.0 or "3", or a bool, is a broken file, not something to coerce
    model_config = ConfigDict(strict=True, extra="ignore")

    format: Literal["icr-index"] = FORMAT
    format_version: Literal[1] = FORMAT_VERSION
    modality: Modality
    checkpoint_sha256: str
    checkpoint_path: str
    dim: int = Field(ge=1)
    factory: str
    factory_reason: str
    ntotal: int = Field(ge=0)
    gallery_count: int = Field(ge=0)
    distractor_count: int = Field(ge=0)
    recall_check: dict[str, Any]
    build_seconds: float
    peak_rss_mb: float
    created: str
    data: dict[str, Any]
    built_on: Literal["cpu", "gpu"] = "cpu"  # where FAISS trained and filled the index
    metric: Literal["inner_product"] = METRIC
    # sha256 of each file the build wrote (index.faiss, metadata.sqlite), checked on load
    files: dict[str, str] = Field(default_factory=dict)
    # the user's metadata fields stored per image (photo folder, embeddings): what filters may name
    metadata_fields: list[str] = Field(default_factory=list)
    # {field: the JSON kinds its stored values have}, so a filter comparing a field with a value of
    # another kind is refused instead of matching nothing. None: built before kinds were recorded
    # (the server then reads them from metadata.sqlite once at load).
    metadata_field_types: dict[str, list[FieldKind]] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)  # free-form build details (not validated)
    # A compacted folder (index/live_compact.py) folds a living index's write log up to ``base_seq``
    # into its build: it holds the images added online (``added_count``, ids from the build's
    # ntotal up) and has ``holes``, ids below ntotal with no vector (deleted before it was written,
    # listed in holes.npy). ntotal stays the id space: every id ever given is below it.
    base_seq: int = Field(default=0, ge=0)
    added_count: int = Field(default=0, ge=0)
    holes: int = Field(default=0, ge=0)
    # A shard (index/shard.py) holds the ids [lo, hi) of the id space: the others are not its images
    # and are not listed as holes (a list of them would cost 8 bytes per id of the whole index).
    id_range: list[int] | None = None
    # A re-ranked index (``...,RFlat``, index/rerank.py): its raw vectors' file and how many candidates
    # a search re-ranks ({file, k_factor, min_candidates}); None for every other factory.
    rerank: dict[str, Any] | None = None

    @field_validator("recall_check")
    @classmethod
    def _recall_check(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked(_RecallCheck, value)

    @field_validator("data")
    @classmethod
    def _data(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked(_DataSource, value)

    @model_validator(mode="after")
    def _counts_add_up(self) -> Manifest:
        if self.gallery_count + self.distractor_count + self.added_count != self.ntotal:
            raise ValueError(
                f"gallery_count {self.gallery_count} + distractor_count {self.distractor_count} "
                f"+ added_count {self.added_count} != ntotal {self.ntotal}"
            )
        lo, hi = self.own_ids
        if not 0 <= lo <= hi <= self.ntotal or (self.id_range is not None and len(self.id_range) != 2):
            raise ValueError(
                f"id_range {self.id_range}: not [lo, hi] with 0 <= lo <= hi <= ntotal {self.ntotal}"
            )
        if self.holes > hi - lo:
            raise ValueError(f"holes {self.holes} > the {hi - lo} ids of {self.own_ids}")
        return self

    @property
    def own_ids(self) -> tuple[int, int]:
        """[lo, hi): the ids this folder's images may have (a shard's range; else the id space)."""
        if self.id_range is None:
            return 0, self.ntotal
        return int(self.id_range[0]), int(self.id_range[-1])

    @property
    def built(self) -> int:
        """Ids of the build itself (below it): the id space less the images a compaction folded in."""
        return self.ntotal - self.added_count

    @property
    def vectors(self) -> int:
        """Vectors in index.faiss (and rows in metadata.sqlite): its ids less its holes."""
        lo, hi = self.own_ids
        return hi - lo - self.holes

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()  # format and format_version first: a reader sees what the file is

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, d: Any, source: str = MANIFEST_FILE) -> Manifest:
        """Validated manifest; ValueError naming ``source`` and the bad fields. Unknown keys are ignored."""
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
        return validated(cls, d, source, "index manifest", hint)

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
        parts = ["icr index build", f"--checkpoint {checkpoint if checkpoint is not None else 'C'}"]
        kind = self.data.get("kind")
        if kind == "images":
            parts.append(f"--images {self.data.get('path')}")
            if self.data.get("metadata"):
                parts.append(f"--metadata {self.data['metadata']}")
        elif kind == "embeddings":
            parts.append(f"--embeddings {self.data.get('path')}")
        else:
            parts += [f"--data {self.data.get('path', 'D')}", f"--split {self.data.get('split', 'test')}"]
        if self.modality != "image":
            parts.append(f"--modality {self.modality}")
        source = self.data.get("distractor_source")
        if self.distractor_count and source == "generator":
            parts.append(f"--distractors {self.distractor_count}")
        elif (
            self.distractor_count
            and source
            and Path(source).is_dir()
            and not (Path(source) / "img_emb").is_dir()
        ):
            parts.append(f"--distractor-images {source}")
        elif self.distractor_count and source:
            parts.append(f"--distractor-embeddings {source}")
        parts.append(f"--out {index_dir if index_dir is not None else 'DIR'}")
        return " ".join(parts)


def check_compatible(
    manifest: Manifest,
    checkpoint: CheckpointMeta | str,
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
    metric: str | None
    if isinstance(checkpoint, str):
        sha, metric = checkpoint, None
    else:
        sha, metric = checkpoint.weights_sha256, checkpoint.metric
        dim = checkpoint.embed_dim if dim is None else dim
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
