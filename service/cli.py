"""``icr serve``: run the HTTP service over an index folder and its checkpoint."""

from __future__ import annotations

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


def serve(settings: Any, log_level: str = "info") -> None:
    """Check the artifacts agree, then serve until interrupted (Ctrl-C)."""
    import uvicorn

    from icr.service.http_protocol import KEEP_ALIVE_SECONDS, bounded_protocol
    from icr.service.jobs import JobStore
    from icr.service.loaded_index import preflight
    from icr.service.main import create_app

    # Configuration errors stop here with one line and exit status 2, not as a traceback from the app.
    preflight(settings.index, settings.checkpoint, settings.caption_index)
    JobStore(settings.jobs_path)
    app = create_app(settings)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    typer.echo(
        f"serving on http://{host}:{settings.port}/  (API docs: /docs, metrics: /metrics; Ctrl-C stops)"
    )
    # What bounds slow and greedy clients, and what uvicorn leaves unbounded: service/http_protocol.py.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        http=bounded_protocol(settings.header_timeout_seconds, settings.max_connections_per_client),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=settings.max_connections,
        # uvicorn would trust X-Forwarded-For from 127.0.0.1; only ICR_TRUSTED_PROXIES may name a
        # client (service/client_address.py)
        proxy_headers=False,
    )


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
) -> None:
    """Serve text->image and image->text search, benchmark jobs and the search page over HTTP.

    Every setting can also come from an ICR_* environment variable or --config file (ICR_API_KEY,
    ICR_MAX_K, ICR_SEARCH_DEPTH, ICR_FAISS_THREADS, ICR_DATASETS='{"coco": "/data/coco"}', ...).
    The checkpoint and indices must come from the same weights; otherwise it stops with the command
    that rebuilds the index.

    Examples:

      icr serve --index icr-demo/index/images --caption-index icr-demo/index/captions

      icr serve --index idx --checkpoint runs/coco/best --host 0.0.0.0 --port 8080 --dataset coco=/data/coco

      ICR_API_KEY=secret icr serve --config /etc/icr.env
    """
    settings = settings_from(
        config,
        index=index,
        checkpoint=checkpoint,
        caption_index=caption_index,
        host=host,
        port=port,
        datasets=_datasets(dataset),
    )
    serve(settings, log_level)
