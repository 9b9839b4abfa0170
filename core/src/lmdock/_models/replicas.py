"""How many Ray Serve replicas run a model under ``lmdock serve`` (``server/_ray.py`` runs them), from
``--replicas``, the model's ``replicas`` / ``autoscaling`` / ``ray_actor_options`` and ``[server]``'s.
Apart from the server so that a config file is checked without the server's packages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmdock._config.model import ModelConfig
from lmdock._config.server import ServerConfig


@dataclass(frozen=True)
class ReplicaPlan:
    """How one model runs on Ray Serve: a fixed count, or the autoscaler's bounds; each replica's actor options."""

    num_replicas: int | None
    autoscaling: dict[str, Any] | None
    actor_options: dict[str, Any] = field(default_factory=dict)

    @property
    def on_ray(self) -> bool:
        return self.autoscaling is not None or (self.num_replicas or 1) > 1

    @property
    def cpus(self) -> float:
        """The CPUs the most replicas it may run ask for."""
        most = self.autoscaling["max_replicas"] if self.autoscaling is not None else self.num_replicas or 1
        return most * self.actor_options["num_cpus"]


def replica_plan(mc: ModelConfig, settings: ServerConfig, replicas: int | None) -> ReplicaPlan:
    """``replicas`` (``--replicas``) over the model's keys, over ``[server]``'s."""
    actor = {"num_cpus": 1, **settings.ray_actor_options, **(mc.ray_actor_options or {})}
    if replicas is not None:
        return ReplicaPlan(replicas, None, actor)
    if mc.replicas is not None or mc.autoscaling is not None:
        return ReplicaPlan(mc.replicas, mc.autoscaling, actor)
    return ReplicaPlan(settings.replicas, settings.autoscaling, actor)
