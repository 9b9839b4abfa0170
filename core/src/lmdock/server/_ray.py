"""``lmdock serve --replicas N``: a model's engine as a Ray Serve deployment of replicas, behind the one
``lmdock serve`` front end (``pip install "lmdock[ray]"``).

The seam is the engine, nothing above it.  Each replica loads the model (the ``LLM(...)`` call a plain
server makes); the front end loads none: its ``LLM`` is made over a :class:`RemoteEngine` that holds
what the routes read from an engine (tokenizer, chat template, limits, generation config; a replica's
:meth:`ReplicaEngine.facts`), whose ``submit`` sends the request to the deployment's handle and streams
the replica's snapshots back into the route's sink, and whose ``abort`` cancels that stream (Ray Serve
cancels the replica's generator, which aborts its engine request).  So routes, auth, errors, metrics
and drain are the same code as a plain ``lmdock serve``.  The handle routes by prompt prefix
(``_ray_router.py``).

A replica that dies before a request's first output costs nothing: the request is sent again (Ray
Serve routes it to a live replica).  After its first output it fails with ``EngineClosedError`` (503
with Retry-After): what was streamed cannot be taken back.  Ray Serve starts a replacement.

How many replicas (``lmdock._models.replicas``): ``--replicas``, else the model's ``replicas`` or
``autoscaling`` (Ray Serve's autoscaler between min and max, on ``target_ongoing_requests``), else
``[server]``'s; each an actor with ``ray_actor_options`` (``num_cpus`` 1 unless given).  The cluster is
the one ``RAY_ADDRESS`` names, else a local one with the CPUs the replicas ask for (at least this
machine's); Ray Serve's own HTTP proxy is off (the front end is the HTTP server).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from lmdock._config.model import ModelConfig
from lmdock._models.replicas import ReplicaPlan
from lmdock._plugin.errors import ConfigError, EngineClosedError
from lmdock.backend import RequestEngineBase

#: the Ray Serve application holding model NAME's replicas
APP_PREFIX = "lmdock-"

#: times a request is sent again when its replica dies before it streamed anything
RETRIES = 2



def start_ray(cpus: float) -> None:
    """Join the cluster ``RAY_ADDRESS`` names, else start a local one with ``cpus`` CPUs (at least this
    machine's), and start Ray Serve without its proxy."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError('Ray Serve replicas (--replicas, replicas, autoscaling) need Ray Serve, which is not installed: '
                          'pip install "lmdock[ray]"', key="server.replicas") from None
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, int(cpus + 0.999)), log_to_driver=False, include_dashboard=False)
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
    """One replica: a model loaded by ``loader`` (an ``LLM(...)`` call), whose engine runs the requests
    the front end sends."""

    def __init__(self, loader: Callable[[], Any]) -> None:
        from ray import serve

        self.llm = loader()
        self.replica = serve.get_replica_context().replica_id.unique_id

    def facts(self) -> dict[str, Any]:
        """The backend's name and what the front end's routes read from an engine."""
        engine: Any = self.llm.engine
        facts = {"backend": self.llm.backend.name, "tokenizer": engine.tokenizer, "max_seq_len": engine.max_seq_len,
                 "generation_config": engine.generation_config}
        if engine.kind == "pooling":  # what the pooling routes read of an embedding model or a cross-encoder
            facts.update(task=engine.task, hidden_size=engine.hidden_size, pooling_type=engine.pooling_type, normalize=engine.normalize)
        return facts

    async def generate(self, request: Any) -> Any:
        """Yield ``(replica id, snapshot, stats)`` for ``request``, the engine's stats with the first and
        the last snapshot (else None); cancelled (the client left), abort it.  Snapshots are cumulative,
        so of those queued while the last one was sent only the newest goes: a front end that reads
        slower than the engine steps gets fewer, fuller ones (each costs a message through Ray)."""
        stream = await self.llm.open_stream(request)  # a grammar compiles off this replica's loop
        first = True
        try:
            async for item in stream:
                yield self.replica, item, self.llm.stats() if first or item.finished else None
                first = False
        finally:
            stream.close()


class RemoteEngine(RequestEngineBase):
    """The front end's engine for a model served by replicas: requests go to the deployment; the
    attributes the routes read are a replica's (:meth:`ReplicaEngine.facts`)."""

    def __init__(self, facts: dict[str, Any], handle: Any, name: str) -> None:
        self.facts = facts
        self.handle = handle
        self.name = name
        self.tasks: dict[str, asyncio.Task[None]] = {}
        #: the replica running each request in flight (from its first snapshot; absent: not started yet)
        self.running: dict[str, str] = {}
        #: requests each replica has served (its first snapshot came from it), for /stats and /metrics
        self.served: Counter[str] = Counter()
        #: each replica's stats as it last sent them (with a request's first and last snapshot)
        self.reported: dict[str, dict[str, Any]] = {}

    #: submit schedules a task on the server's loop (the replicas compile grammars): call it there
    submit_on_loop = True

    def __getattr__(self, attr: str) -> Any:
        try:
            return self.__dict__["facts"][attr]
        except KeyError:
            raise AttributeError(attr) from None

    def submit(self, request: Any, sink: Any) -> None:
        """Forward ``request`` (called on the server's event loop, as its routes do)."""
        self.tasks[request.request_id] = asyncio.get_running_loop().create_task(self._forward(request, sink))

    async def _forward(self, request: Any, sink: Any) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError

        replica = None
        try:
            for attempt in range(RETRIES + 1):
                try:
                    async for replica, out, stats in self.handle.options(stream=True).generate.remote(request):
                        if request.request_id not in self.running:
                            self.running[request.request_id] = replica
                            self.served[replica] += 1
                        if stats is not None:
                            self.reported[replica] = {**stats, "at": time.time()}
                        sink.put(out)
                    return
                except (RayActorError, ActorUnavailableError) as exc:
                    if replica is not None:  # it streamed: what was sent cannot be taken back
                        self.reported.pop(replica, None)
                        sink.fail(EngineClosedError(f"model {self.name!r}: the replica serving the request stopped "
                                                    f"({type(exc).__name__}); Ray Serve replaces it, retry"))
                        return
                    if attempt == RETRIES:
                        sink.fail(EngineClosedError(f"model {self.name!r}: {RETRIES + 1} replicas stopped before the "
                                                    f"request started ({type(exc).__name__}); retry later"))
                    else:
                        await asyncio.sleep(0.1 * (attempt + 1))  # time for Ray Serve to see the replica gone
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the replica's own error (a RayTaskError is also its cause's type)
            sink.fail(exc)
        finally:
            self.tasks.pop(request.request_id, None)
            self.running.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def stats(self) -> dict[str, Any]:
        """The model's counts over its replicas, and each replica's under ``replicas``: requests running
        (sent to it, as the front end counts them), waiting (sent to Ray Serve, not started on a replica
        yet), served in all; KV-cache usage, sequences held and preemptions as the replica last reported."""
        per: dict[str, dict[str, Any]] = {}
        running = Counter(self.running.values())
        for replica in set(self.served) | set(self.reported):
            reported = self.reported.get(replica, {})
            per[replica] = {"num_requests_running": running[replica],
                            "requests_total": self.served[replica],
                            **{k: reported[k] for k in ("kv_cache_usage_perc", "num_sequences_held", "num_preemptions_total")
                               if k in reported}}
        usage = [s["kv_cache_usage_perc"] for s in per.values() if "kv_cache_usage_perc" in s]
        return {"num_requests_running": len(self.running), "num_requests_waiting": len(self.tasks) - len(self.running),
                "kv_cache_usage_perc": sum(usage) / len(usage) if usage else 0.0,
                "num_preemptions_total": sum(s.get("num_preemptions_total", 0) for s in per.values()),
                "num_sequences_held": sum(s.get("num_sequences_held", 0) for s in per.values()),
                "replica_requests": dict(self.served), "replicas": per}

    def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        from ray import serve

        serve.delete(APP_PREFIX + self.name)


def replicated(name: str, plan: ReplicaPlan, model: str, **kwargs: Any) -> Callable[[], Any]:
    """A loader for the front end: ``LLM(model, **kwargs)`` in each replica of ``plan``, and here an
    ``LLM`` over their :class:`RemoteEngine` (the model is not loaded in the front end)."""
    from lmdock._llm.facade import LLM

    def deploy(mc: ModelConfig) -> tuple[RemoteEngine, Any]:
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from lmdock._plugin.manager import get_registry
        from lmdock.server._ray_router import PrefixAffinityRouter

        sched = mc.scheduler  # each replica takes as many requests as its scheduler holds
        count = {"autoscaling_config": plan.autoscaling} if plan.autoscaling is not None else {"num_replicas": plan.num_replicas}
        deployment = serve.deployment(ReplicaEngine, name=name, ray_actor_options=plan.actor_options,
                                      max_ongoing_requests=sched.max_num_seqs + sched.max_waiting,
                                      request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
                                      **count)
        handle = serve.run(deployment.bind(functools.partial(LLM, model, **kwargs)), name=APP_PREFIX + name,
                           route_prefix=None)
        facts = handle.facts.remote().result()
        return RemoteEngine(facts, handle, name), get_registry().backend(facts["backend"])

    return functools.partial(LLM.over_engine, model, deploy, **kwargs)
