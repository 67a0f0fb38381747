"""Service settings: environment variables prefixed ``ICR_`` or a ``KEY=value`` file (``ICR_CONFIG``).

``icr serve`` options override both. Datasets for benchmark jobs are named here, never by clients:
``ICR_DATASETS='{"synthetic": "icr-demo/data", "coco": "/data/coco"}'``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from icr.core.devices import Device
from icr.core.state_dir import default_state_dir
from icr.service.client_address import trusted_networks

DATASET_NAMES = ("flickr30k", "coco", "synthetic")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ICR_", extra="forbid")

    index: Path = Field(..., description="Image index folder (icr index build): text->image search.")
    checkpoint: Path | None = Field(None, description="Checkpoint folder; default: the index manifest's.")
    caption_index: Path | None = Field(
        None, description="Caption index folder (--modality text): image->text."
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: Device = Field(
        "auto", description="auto (CUDA when a GPU is visible), cpu or cuda: where queries are encoded."
    )
    gpu: str = Field("auto", description="FAISS on the GPU: auto, on or off.")
    faiss_threads: int = Field(
        1,
        ge=1,
        description="Threads for the search of one query. On one, a lone exact query is FAISS's "
        "scan; on more, the exact kernel's matrix-vector scan, which uses them (FAISS's parallel scan "
        "of one query is slower than its one-thread one; icr bench measures both). Batches use "
        "every core.",
    )
    micro_batch: int = Field(
        64,
        ge=1,
        description="Most queries merged into one FAISS search when requests overlap (1: never). An "
        "exact search of a batch reads the gallery once, so throughput grows with concurrency.",
    )
    max_k: int = Field(100, ge=1, le=1000)
    search_depth: int = Field(
        1000,
        ge=1,
        description="Neighbours retrieved per query before thresholding; offset is at most this minus max_k.",
    )
    max_text_chars: int = Field(1000, ge=1)
    max_upload_bytes: int = Field(
        10 << 20,
        ge=1024,
        description="Image uploads (search by image, POST /v1/images:upload) and batches of embeddings "
        "(POST /v1/images, admin only).",
    )
    max_json_bytes: int = Field(
        64 << 10,
        ge=1024,
        le=16 << 20,
        description="Every other request body (JSON: searches, jobs). Bodies are parsed and validated on "
        "the event loop, so this bounds what one request can make every other client wait.",
    )
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="Larger uploads are refused (decompression bombs)."
    )
    max_aspect_ratio: float = Field(
        20.0,
        ge=1.0,
        le=1000.0,
        description="Uploads whose longer side exceeds this many times the shorter are refused: scaling "
        "the shorter side to the model's size would make them huge.",
    )
    max_concurrent_decodes: int = Field(
        2,
        ge=1,
        le=64,
        description="Images decoded at once (uploads searched by image, gallery images shown): each can "
        "take several hundred MB (a 40 M-pixel image is 160 MB decoded), so this bounds the server's memory.",
    )
    decode_wait_seconds: float = Field(
        10.0,
        ge=0.0,
        le=600.0,
        description="An image request waits this long for a free decode (ICR_MAX_CONCURRENT_DECODES); "
        "then it gets 503 with Retry-After. A burst is queued and answered; sustained overload is refused "
        "at once instead of timing out.",
    )
    load_retry_seconds: float = Field(
        2.0,
        gt=0.0,
        le=600.0,
        description="When loading the model or an index fails, retry after this many seconds, doubling "
        "up to 60; /readyz says why it is not ready meanwhile.",
    )
    watch_seconds: float = Field(
        2.0,
        ge=0.0,
        le=3600.0,
        description="Check the served files this often; changed and whole: swapped in, changed in place and "
        "broken: searches answer 503 until they are whole (0: no watching; POST /v1/admin/reload only).",
    )
    thumbnail_size: int = Field(160, ge=16, le=1024)
    api_key: str | None = Field(
        None,
        description="When set, search, images, info and job listings need it (X-API-Key header).",
    )
    admin_key: str | None = Field(
        None,
        description="Submitting and cancelling benchmark jobs needs it (X-API-Key); when unset, only "
        "clients on this machine may.",
    )
    refusals_per_second: float = Field(
        20.0,
        ge=0.0,
        description="Refused requests (4xx other than 429) one client may send per second, twice that at "
        "once, at full speed; beyond, each refusal is answered after 1 s, so a client looping bad "
        "requests cannot take the server from others (0: never slowed).",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description='Reverse proxies (addresses or CIDR blocks, a JSON list such as ["127.0.0.1"]) whose '
        "X-Forwarded-For names the client; from any other peer the header is ignored. Decides which "
        "client is local (admin without ICR_ADMIN_KEY) and whose refused requests are slowed.",
    )
    metrics_need_key: bool = Field(False, description="/metrics needs the API key too.")
    health_need_key: bool = Field(
        False,
        description="/healthz and /readyz need the API key too (probes then send X-API-Key); /readyz "
        "says why loading failed.",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins allowed to call the API from other sites (a JSON list such as "
        '["https://app.example"]); none by default.',
    )
    body_timeout_seconds: float = Field(
        30.0,
        gt=0.0,
        le=600.0,
        description="A request's whole body must arrive within this many seconds of its headers, or it is "
        "refused (408): a client trickling bytes cannot hold a worker (a 10 MiB upload needs ~3 Mbit/s).",
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="A request's headers must arrive within this many seconds of connecting (or of the "
        "previous response on a kept-alive connection), or the connection is closed with 408.",
    )
    max_connections: int = Field(
        512,
        ge=1,
        description="Open connections (or running requests) beyond this get 503 at once (uvicorn's "
        "limit_concurrency): memory and file handles stay bounded however many clients connect.",
    )
    max_connections_per_client: int = Field(
        64,
        ge=0,
        description="Open connections one peer address may hold; more get 429 with Retry-After at once, "
        "so one client cannot take all of ICR_MAX_CONNECTIONS (0: no bound). Behind a reverse proxy "
        "every client is the proxy: raise it above the proxy's upstream connections, or set 0.",
    )
    datasets: dict[str, Path] = Field(default_factory=dict, description="Benchmark datasets by name.")
    state_dir: Path | None = Field(
        None,
        description="Where the server keeps its own state (the job database, the relevance labels "
        "given on the search page: feedback.sqlite); default "
        "$XDG_STATE_HOME/icr or ~/.local/state/icr, never inside an index folder that a rebuild replaces.",
    )
    writes: bool = Field(
        True,
        description="Accept image writes (add, patch, delete: admin only) into STATE_DIR/writes.sqlite, "
        "seen by every server on that state directory; false: the index is read-only.",
    )
    writes_poll_seconds: float = Field(
        0.2,
        gt=0.0,
        le=60.0,
        description="How often a server applies what other servers on its state directory wrote: the "
        "longest a write takes to be searchable on the other servers.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Server processes on the one port (icr serve --workers): one per core uses every "
        "core; they share the write log and the jobs database, each holds the index (or ICR_MMAP).",
    )
    mmap: bool = Field(
        False,
        description="Read the index memory-mapped from the page cache instead of copying it into "
        "memory: one copy shared by every worker, but an inverted file searched from mapped pages "
        "measured 1.7x slower than from its own memory (docs/serving-beyond-one-machine.md).",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Threads each server process encodes queries with (torch intra-op); default: the "
        "cores divided among the workers. More threads than cores spin and take CPU from searches.",
    )
    shard_failure: Literal["partial", "unavailable"] = Field(
        "partial",
        description="When an index shard does not answer (a sharded server, icr serve --ray): partial "
        "answers without it (passed_is_exact false and a warning naming it), or unavailable (503).",
    )
    shard_timeout_seconds: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="How long a sharded server waits for the shards' answers to one search before it "
        "counts the late ones as down.",
    )
    jobs_db: Path | None = Field(
        None, description="SQLite file of benchmark jobs, shared by replicas; default: STATE_DIR/jobs.sqlite."
    )
    max_benchmark_distractors: int = Field(100_000, ge=0)
    max_queued_jobs: int = Field(20, ge=1, description="More queued benchmark jobs are refused with 429.")
    job_lease_seconds: float = Field(
        60.0,
        ge=1.0,
        le=3600.0,
        description="A running job's lease, renewed by its server every third of it; another server marks "
        "the job interrupted only after it expired.",
    )
    job_retention_days: float = Field(30.0, gt=0.0, description="Finished jobs older than this are deleted.")

    @model_validator(mode="after")
    def _depth_holds_a_page(self) -> Settings:
        if self.max_k > self.search_depth:
            raise ValueError(f"max_k ({self.max_k}) must not exceed search_depth ({self.search_depth})")
        return self

    @field_validator("datasets")
    @classmethod
    def _known_names(cls, value: dict[str, Path]) -> dict[str, Path]:
        unknown = sorted(set(value) - set(DATASET_NAMES))
        if unknown:
            raise ValueError(
                f"dataset names must be among {', '.join(DATASET_NAMES)}, got {', '.join(unknown)}"
            )
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        trusted_networks(tuple(value))  # a bad entry stops the server at start-up, named
        return value

    @property
    def encode_threads(self) -> int:
        return self.torch_threads or max(1, len(os.sched_getaffinity(0)) // self.workers)

    @property
    def state_path(self) -> Path:
        return self.state_dir or default_state_dir()

    @property
    def jobs_path(self) -> Path:
        if self.jobs_db is not None:
            return self.jobs_db
        return self.state_path / "jobs.sqlite"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings (a cached FastAPI dependency; tests override it)."""
    env_file = os.environ.get("ICR_CONFIG")
    return Settings(_env_file=env_file) if env_file else Settings()
