"""``icr serve``: run the HTTP service over an index folder and its checkpoint."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from icr.core.cli_support import fail_cleanly

if TYPE_CHECKING:
    from icr.service.config import Settings


# Settings that `icr serve` also takes as options, named with them in error messages.
_OPTIONS = {
    "index": "--index",
    "checkpoint": "--checkpoint",
    "caption_index": "--caption-index",
    "host": "--host",
    "port": "--port",
    "datasets": "--dataset",
}
# What a setting that must be JSON looks like, for the message when it is not.
_JSON_EXAMPLES = {"datasets": '\'{"coco": "/data/coco"}\'', "cors_origins": "'[\"https://app.example\"]'"}


def settings_from(config: Path | None, **overrides: Any) -> Settings:
    """Settings from ICR_* variables and the ``--config`` file, with command-line options on top;
    a bad value is one line naming its variable (ValueError)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from icr.service.config import Settings

    given = {k: v for k, v in overrides.items() if v is not None}
    env_file = config if config is not None else os.environ.get("ICR_CONFIG")
    if env_file is not None and not Path(env_file).is_file():
        raise FileNotFoundError(f"{env_file}: config file not found (KEY=value lines such as ICR_INDEX=...)")
    try:
        return Settings(_env_file=env_file, **given)
    except SettingsError as err:  # a value that must be JSON is not (pydantic names the field only)
        field = re.search(r'field "(\w+)"', str(err))
        name = field.group(1) if field else "?"
        example = f"; e.g. ICR_{name.upper()}={_JSON_EXAMPLES[name]}" if name in _JSON_EXAMPLES else ""
        raise ValueError(
            f"invalid settings: ICR_{name.upper()}: not valid JSON ({err.__cause__}){example}"
        ) from None
    except ValidationError as err:
        raise ValueError(
            f"invalid settings: {_setting_errors(err.errors())} (set in the environment, the --config file "
            "or the matching option of `icr serve --help`)"
        ) from None


def _setting_errors(errors: list[Any]) -> str:
    """``ICR_MAX_K: Input should be a valid integer (got 'abc')``: each error named by its variable."""
    parts = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())]
        name = f"ICR_{loc[0].upper()}" + "".join(f"[{p}]" for p in loc[1:]) if loc else "settings"
        if loc and loc[0] in _OPTIONS:
            name += f" ({_OPTIONS[loc[0]]})"
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        given = error.get("input")
        shown = (
            f" (got {given!r})"
            if loc and isinstance(given, str | int | float) and len(str(given)) <= 60
            else ""
        )
        parts.append(f"{name}: {message}{shown}")
    return "; ".join(parts)


def _url(settings: Any) -> str:
    """Where the server answers (an IPv6 host in brackets)."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}/"


def serve(settings: Any, log_level: str = "info", shards: Any = None) -> None:
    """Check the artifacts agree, then serve until interrupted (Ctrl-C); ``shards``: connects to
    the shards of a sharded index (``settings.index`` is one of them)."""
    import uvicorn

    from icr.service.http_protocol import KEEP_ALIVE_SECONDS, bounded_protocol
    from icr.service.jobs import JobStore
    from icr.service.loaded_index import preflight
    from icr.service.main import create_app

    # Configuration errors stop here with one line and exit status 2, not as a traceback from the app.
    preflight(settings.index, settings.checkpoint, settings.caption_index)
    JobStore(settings.jobs_path)
    typer.echo(f"serving on {_url(settings)}  (API docs: /docs, metrics: /metrics; Ctrl-C stops)")
    # What bounds slow and greedy clients, and what uvicorn leaves unbounded: service/http_protocol.py.
    app: Any
    protocol: Any
    if settings.workers > 1:  # spawned worker processes: each builds the app and protocol itself
        from icr.service import workers

        os.environ.update(workers.environment(settings))
        app, protocol = workers.APP, workers.PROTOCOL
    else:
        app = create_app(settings, shards)
        protocol = bounded_protocol(settings.header_timeout_seconds, settings.max_connections_per_client)
    uvicorn.run(
        app,
        factory=settings.workers > 1,
        workers=settings.workers,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        http=protocol,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=settings.max_connections,
        # uvicorn would trust X-Forwarded-For from 127.0.0.1; only ICR_TRUSTED_PROXIES may name a
        # client (service/client_address.py)
        proxy_headers=False,
    )


def shard_folders(directory: Path) -> list[Path]:
    """The ``shard-<s>-of-<S>`` folders ``icr index shard`` wrote into ``directory``, in order."""
    found = sorted(directory.glob("shard-*-of-*"), key=lambda p: int(p.name.split("-")[1]))
    if not found:
        raise FileNotFoundError(
            f"--shards {directory}: no shard-<s>-of-<S> folders in it; cut an index into shards with "
            f"`icr index shard INDEX --shards S --out {directory}`"
        )
    return found


def serve_shards(
    settings: Any, shards: Path, *, ray: bool, address: str | None, replicas: int, log_level: str
) -> None:
    """Serve the shard folders in ``shards`` as one index: in this process (each shard searched on
    its own threads), or with ``ray`` as Ray Serve applications (a local Ray started for the
    purpose, or the cluster at ``address``) until interrupted."""
    if settings.workers > 1:  # on Ray the coordinator would ignore it, in process it cannot share the shards
        raise ValueError("--workers serves one index folder; a sharded index scales with --ray --replicas")
    folders = shard_folders(shards)
    settings = settings.model_copy(update={"index": folders[0]})
    if not ray:
        from concurrent.futures import ThreadPoolExecutor

        from icr.service.shard_replica import ShardReplica, shard_writes
        from icr.service.sharded_index import LocalShard

        pool = ThreadPoolExecutor(4 * len(folders))

        def connect() -> list[Any]:
            return [
                LocalShard(
                    ShardReplica(
                        f,
                        gpu=settings.gpu,
                        faiss_threads=settings.faiss_threads,
                        writes=shard_writes(settings, f),
                    ),
                    pool,
                )
                for f in folders
            ]

        serve(settings, log_level, shards=connect)
        return
    import signal
    import threading

    try:
        import ray as ray_lib

        from icr.service.ray_serving import deploy, start_serve, undeploy
    except ImportError as err:
        raise ValueError(
            f"--ray needs Ray Serve ({err}): pip install 'icr[distributed]' (or 'ray[serve]')"
        ) from None
    from icr.service.loaded_index import preflight

    preflight(settings.index, settings.checkpoint, settings.caption_index)
    level = logging.getLevelNamesMapping().get(log_level.upper(), logging.INFO)
    ray_lib.init(address=address, logging_level=level, log_to_driver=False)
    started = start_serve(settings.host, settings.port)
    typer.echo(f"deploying {len(folders)} shards x {replicas} replicas and the coordinator on Ray ...")
    names = deploy(settings, folders, replicas=replicas)
    typer.echo(f"serving on {_url(settings)} through Ray Serve (Ctrl-C stops and removes the apps)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if address is not None:  # a cluster that outlives this command
        undeploy(names, started)
    ray_lib.shutdown()  # a Ray started by this command stops with it


def _datasets(values: list[str] | None) -> dict[str, Path] | None:
    if not values:
        return None
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--dataset {value!r}: expected NAME=PATH, e.g. --dataset synthetic=icr-demo/data"
            )
        out[name] = Path(path)
    return out


@fail_cleanly
def serve_command(
    index: Annotated[
        Path | None, typer.Option(help="Image index folder (icr index build). Env: ICR_INDEX.")
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", "-m", help="Checkpoint folder (default: the index's).")
    ] = None,
    caption_index: Annotated[
        Path | None, typer.Option(help="Caption index folder (--modality text) for image->text search.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Interface to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    dataset: Annotated[
        list[str] | None,
        typer.Option(help="Benchmark dataset NAME=PATH (flickr30k, coco, synthetic); repeatable."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="File of ICR_KEY=value settings (see service/config.py).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    shards: Annotated[
        Path | None,
        typer.Option(help="Serve the shard folders `icr index shard` wrote into this folder as one index."),
    ] = None,
    ray: Annotated[
        bool, typer.Option("--ray", help="With --shards: each shard a Ray Serve application.")
    ] = False,
    address: Annotated[
        str | None,
        typer.Option(help="With --ray: the Ray cluster to join (e.g. ray://head:10001; default: start one)."),
    ] = None,
    replicas: Annotated[int, typer.Option(min=1, help="With --ray: replicas of each shard.")] = 1,
    workers: Annotated[
        int | None,
        typer.Option(help="Server processes on the port, one per core (default 1; see ICR_MMAP)."),
    ] = None,
) -> None:
    """Serve text->image and image->text search, benchmark jobs and the search page over HTTP.

    Every setting can also come from an ICR_* environment variable or --config file (ICR_API_KEY,
    ICR_MAX_K, ICR_SEARCH_DEPTH, ICR_FAISS_THREADS, ICR_DATASETS='{"coco": "/data/coco"}', ...).
    The checkpoint and indices must come from the same weights; otherwise it stops with the command
    that rebuilds the index.

    Examples:

      icr serve --index icr-demo/index/images --caption-index icr-demo/index/captions

      icr serve --index idx --checkpoint runs/coco/best --host 0.0.0.0 --port 8080 --dataset coco=/data/coco

      icr serve --index idx --workers 2   (one process per core)

      ICR_API_KEY=secret icr serve --config /etc/icr.env

      icr index shard idx --shards 4 --out idx-shards && icr serve --shards idx-shards --ray --replicas 2
    """
    if shards is not None and index is not None:
        raise ValueError("give --index (one index folder) or --shards (the folder of its shards), not both")
    if ray and shards is None:
        raise ValueError("--ray serves shards: give --shards DIR (icr index shard cuts an index into them)")
    settings = settings_from(
        config,
        index=shard_folders(shards)[0] if shards is not None else index,
        checkpoint=checkpoint,
        caption_index=caption_index,
        host=host,
        port=port,
        datasets=_datasets(dataset),
        workers=workers,
    )
    if shards is not None:
        serve_shards(settings, shards, ray=ray, address=address, replicas=replicas, log_level=log_level)
    else:
        serve(settings, log_level)
