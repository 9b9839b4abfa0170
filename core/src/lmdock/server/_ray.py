"""``lmdock serve --replicas N``: each model's engine as a Ray Serve deployment of N replicas, behind the
one ``lmdock serve`` front end (``pip install "lmdock[ray]"``).

The seam is the engine, nothing above it: the front end loads the model as ever (its tokenizer, chat
template, limits and sampling defaults answer the routes), then puts a :class:`RemoteEngine` in front
of its engine, whose ``submit`` sends the request to the deployment's handle and streams the replica's
snapshots back into the route's sink, and whose ``abort`` cancels that stream (Ray Serve cancels the
replica's generator, which aborts its engine request).  So routes, auth, errors, metrics and drain are
the same code as a plain ``lmdock serve``.  The handle routes by prompt prefix (``_ray_router.py``).
A replica that dies fails the requests it held with ``EngineClosedError`` (503 with Retry-After);
Ray Serve starts another.

The cluster is the one ``RAY_ADDRESS`` names, else a local one sized to this machine (at least one CPU
per replica); Ray Serve's own HTTP proxy is off (the front end is the HTTP server).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from lmdock._errors import ConfigError, EngineClosedError
from lmdock._sinks import AsyncQueueSink

#: the Ray Serve application holding model NAME's replicas
APP_PREFIX = "lmdock-"


def start_ray(replicas: int) -> None:
    """Join the cluster ``RAY_ADDRESS`` names, else start a local one, and start Ray Serve without its proxy."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(f'{replicas} replicas need Ray Serve, which is not installed: pip install "lmdock[ray]"',
                          key="server.replicas") from None
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, replicas), log_to_driver=False, include_dashboard=False)
    serve.start(proxy_location="Disabled")


def stop_ray() -> None:
    """Delete lmdock's Serve applications and leave the cluster (a local one stops)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class ReplicaEngine:
    """One replica: a model loaded by ``loader`` (the same ``LLM(...)`` call the front end makes), whose
    engine runs the requests the front end sends."""

    def __init__(self, loader: Callable[[], Any]) -> None:
        from ray import serve

        self.llm = loader()
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def generate(self, request: Any) -> Any:
        """Yield ``(replica id, snapshot)`` for ``request``; cancelled (the client left), abort it."""
        sink = AsyncQueueSink(asyncio.get_running_loop())
        engine = self.llm.engine
        engine.submit(request, sink)
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield self.replica, item
        finally:
            if not finished:
                engine.abort(request.request_id)

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, **self.llm.stats()}


class RemoteEngine:
    """The front end's engine for a model served by replicas: requests go to the deployment, the rest
    (tokenizer, limits, generation config) is the local engine's."""

    def __init__(self, local: Any, handle: Any, name: str) -> None:
        self.local = local
        self.handle = handle
        self.name = name
        self.tasks: dict[str, asyncio.Task[None]] = {}
        #: requests each replica has served (its first snapshot came from it), for /stats
        self.served: Counter[str] = Counter()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.local, attr)

    def submit(self, request: Any, sink: Any) -> None:
        """Forward ``request`` (called on the server's event loop, as its routes do)."""
        self.tasks[request.request_id] = asyncio.get_running_loop().create_task(self._forward(request, sink))

    async def _forward(self, request: Any, sink: Any) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError

        first = True
        try:
            async for replica, out in self.handle.options(stream=True).generate.remote(request):
                if first:
                    self.served[replica] += 1
                    first = False
                sink.put(out)
        except (RayActorError, ActorUnavailableError) as exc:
            sink.fail(EngineClosedError(f"model {self.name!r}: the replica serving the request stopped "
                                        f"({type(exc).__name__}); Ray Serve replaces it, retry"))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the replica's own error (a RayTaskError is also its cause's type)
            sink.fail(exc)
        finally:
            self.tasks.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def stats(self) -> dict[str, Any]:
        """Requests in flight to the replicas (as running) and each replica's count of requests served."""
        return {"num_requests_running": len(self.tasks), "replica_requests": dict(self.served)}

    def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        try:
            from ray import serve

            serve.delete(APP_PREFIX + self.name)
        finally:
            self.local.close()


def replicated(loader: Callable[[], Any], name: str, replicas: int) -> Callable[[], Any]:
    """A loader for the front end: ``loader()`` here, and ``replicas`` replicas each running ``loader()``."""

    def load() -> Any:
        from ray import serve

        llm = loader()
        sched = llm.model_config.scheduler  # each replica takes as many requests as its scheduler holds
        from ray.serve.config import RequestRouterConfig

        from lmdock.server._ray_router import PrefixAffinityRouter

        deployment = serve.deployment(ReplicaEngine, name=name, num_replicas=replicas, ray_actor_options={"num_cpus": 1},
                                      max_ongoing_requests=sched.max_num_seqs + sched.max_waiting,
                                      request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter))
        handle = serve.run(deployment.bind(loader), name=APP_PREFIX + name, route_prefix=None)
        llm.wrap_engine(lambda local: RemoteEngine(local, handle, name))
        return llm

    return load
