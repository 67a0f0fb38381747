"""``icr serve --ray``: a sharded index on Ray Serve, behind the same HTTP API.

Each shard is its own Serve application (``icr-shard-<s>``) of ``replicas`` replicas; a replica
loads its shard folder (:class:`service.shard_replica.ShardReplica`, memory-mapped when asked) and
answers the coordinator. The coordinator is one more application (``icr``, route prefix ``/``): a
deployment whose ASGI app is the service's own FastAPI app (:func:`service.main.create_app`), built
in the replica with the shards' handles, so every route, schema and page is the single server's. It
encodes each query once, scatters it to the shards, merges their top ``depth`` and thresholds,
calibrates, filters and pages the merged list (:mod:`service.sharded_index`).

Writes go to the owning shard's replicas (:mod:`service.sharded_index`), which share the shard's
write log in its state directory: ``STATE_DIR/shards/<shard folder>/``, on one file system for all
of that shard's replicas (SQLite's locking: a local disk, not NFS).

Failure: a shard replica that dies mid-request has the call retried on another replica (Serve
restarts the dead one); a shard with no replica answering within ICR_SHARD_TIMEOUT_SECONDS is left
out (a partial answer that names it) or fails the request with 503 (ICR_SHARD_FAILURE=unavailable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError

from icr.service.config import Settings
from icr.service.shard_replica import ShardReplica, shard_writes
from icr.service.sharded_index import ShardBackend, ShardDown, Waiter

log = logging.getLogger("icr.service")

COORDINATOR_APP = "icr"
# A replica that died mid-call is tried again (another replica, or the restarted one) this many times.
RETRIES = 3
# The errors that say a shard's replica is gone or unreachable, not that it answered with an error.
_DOWN = (
    RayActorError,
    ActorDiedError,
    ActorUnavailableError,
    BackPressureError,
    DeploymentUnavailableError,
    RequestCancelledError,
)


def shard_app_name(s: int) -> str:
    return f"icr-shard-{s}"


class ShardDeploymentClass:
    """One replica of one shard; each call runs on a thread, so concurrent searches meet in the
    shard's micro-batcher (one FAISS call for many queries). ``writes``: the shard's state
    directory, shared by its replicas (None: read-only)."""

    def __init__(
        self,
        folder: str,
        gpu: str,
        faiss_threads: int,
        micro_batch: int,
        mmap: bool,
        writes: str | Path | None,
    ) -> None:
        self.replica = ShardReplica(
            folder,
            gpu=gpu,
            faiss_threads=faiss_threads,
            micro_batch=micro_batch,
            mmap=mmap,
            writes=None if writes is None else Path(writes),
        )

    async def call(self, method: str, *args: Any) -> Any:
        """``ShardReplica.<method>(*args)`` for the methods a coordinator calls (ShardReplica.CALLS)."""
        if method not in ShardReplica.CALLS:
            raise ValueError(f"a shard answers {sorted(ShardReplica.CALLS)}, not {method!r}")
        return await asyncio.to_thread(getattr(self.replica, method), *args)


# Serve's decorators return Deployment objects that mypy sees as the classes: typed Any here.
ShardDeployment: Any = serve.deployment(
    ShardDeploymentClass,
    name="ShardDeployment",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=64,
    health_check_period_s=2,
)


class RayShard:
    """A shard reached through its Serve application's handle (any replica; a dead one's call
    is retried on another within the deadline, unless it is an add: the dead replica may have
    made it, and repeating it would add the images twice)."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self.handle = serve.get_deployment_handle("ShardDeployment", app_name=app_name)

    def submit(self, method: str, *args: Any) -> Waiter:
        response = self.handle.call.remote(method, *args)

        def wait(timeout: float) -> Any:
            nonlocal response
            deadline = time.monotonic() + timeout
            retries = 0 if method in ShardReplica.NOT_REPEATABLE else RETRIES
            for attempt in range(retries + 1):
                try:
                    return response.result(timeout_s=max(0.001, deadline - time.monotonic()))
                except (GetTimeoutError, TimeoutError):
                    raise ShardDown(f"no answer in {timeout:.1f} s") from None
                except _DOWN as err:
                    if attempt == retries or time.monotonic() >= deadline:
                        raise ShardDown(f"{type(err).__name__}: {err}") from None
                    log.warning("%s: a replica failed %s (%s); trying again", self.app_name, method, err)
                    response = self.handle.call.remote(method, *args)
            raise AssertionError("unreachable")

        return wait


class CoordinatorClass:
    """The service's FastAPI app over the shards' applications."""

    def __init__(self, settings: dict[str, Any], shard_apps: list[str]) -> None:
        self.settings = Settings(**settings)
        self.shard_apps = shard_apps

    def __serve_build_asgi_app__(self) -> Any:
        from icr.service.main import create_app  # noqa: PLC0415 (built in the replica, not where deployed)

        def connect() -> list[ShardBackend]:
            return [RayShard(name) for name in self.shard_apps]

        return create_app(self.settings, connect)


Coordinator: Any = serve.deployment(
    serve.ingress()(CoordinatorClass),
    name="Coordinator",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=256,
)


def start_serve(host: str, port: int) -> bool:
    """Start Serve's HTTP proxy on ``host:port`` on the connected cluster; returns whether this
    started it (False: it was running already, on that port). ValueError when it runs on another
    port: one cluster has one proxy port, and a second coordinator there would be unreachable."""
    from ray.serve.context import _get_global_client  # noqa: PLC0415 (the one way to ask, in Ray 2.x)
    from ray.serve.exceptions import RayServeException  # noqa: PLC0415

    try:
        client = _get_global_client()
    except RayServeException:  # no Serve on this cluster yet
        client = None
    if client is None:
        serve.start(http_options={"host": host, "port": port})
        return True
    running = client.http_config
    if running.port != port:
        raise ValueError(
            f"Ray Serve already runs on this cluster with its HTTP proxy on port {running.port}: serve "
            f"there (--port {running.port}; its application 'icr' is replaced), or stop it first (serve "
            "shutdown)"
        )
    return False


def undeploy(names: list[str], started: bool) -> None:
    """Take this server off the cluster: Serve itself when this command started it (the next one
    may use another port), else only its applications (the coordinator first)."""
    if started:
        serve.shutdown()
        return
    for name in reversed(names):
        try:
            serve.delete(name)
        except Exception as err:  # the cluster is going down too: nothing left to remove
            log.warning("could not remove %s: %s", name, err)


def deploy_shards(settings: Settings, shards: list[Path], replicas: int = 1) -> list[str]:
    """Deploy each shard folder as the application ``icr-shard-<s>`` of ``replicas`` replicas, on
    the Ray cluster this process is connected to (taking writes, when ``settings.writes``, into its
    own directory under the state directory, which its replicas share); returns the applications'
    names."""
    names = []
    for s, folder in enumerate(shards):
        name = shard_app_name(s)
        app = ShardDeployment.options(num_replicas=replicas).bind(
            str(Path(folder).resolve()),
            settings.gpu,
            settings.faiss_threads,
            settings.micro_batch,
            settings.mmap,
            shard_writes(settings, folder),
        )
        serve.run(app, name=name, route_prefix=None)
        names.append(name)
    return names


def deploy(
    settings: Settings,
    shards: list[Path],
    *,
    replicas: int = 1,
    coordinators: int = 1,
) -> list[str]:
    """Deploy the shards (:func:`deploy_shards`), then the coordinator (``coordinators`` replicas)
    at ``/``; returns the applications' names. ``settings.index`` must be one of the shards (the
    agreement check)."""
    names = deploy_shards(settings, shards, replicas)
    dump = settings.model_dump(mode="json", exclude_none=True)
    coordinator = Coordinator.options(num_replicas=coordinators).bind(dump, names)
    serve.run(coordinator, name=COORDINATOR_APP, route_prefix="/")
    return [*names, COORDINATOR_APP]
