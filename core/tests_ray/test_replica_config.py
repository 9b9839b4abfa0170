"""Replicas from the config file alone (no ``--replicas``): ``[server]``'s ``autoscaling`` and
``ray_actor_options`` for one model, a model's own ``replicas`` for another (loaded on its first
request), on a local Ray cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_helpers import DOCUMENTED, Server, models_dir

AUTOSCALED = ('autoscaling = { min = 1, max = 2, target_ongoing_requests = 1, upscale_delay_s = 0 }\n'
              'ray_actor_options = { num_cpus = 0.5 }\n')


@pytest.fixture(scope="module")
def configured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tales = f'[models.tales]\nmodel = "{models_dir()}"\nbackend = "hf"\nreplicas = 2\n'
    s = Server(tmp_path_factory.mktemp("configured"), server_table=AUTOSCALED, extra_models=tales, env={"RAY_ADDRESS": None})
    yield s
    s.stop()


def _complete(server: Server, model: str, max_tokens: int = 40) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0).choices[0].text


def _replicas(server: Server, model: str) -> dict[str, int]:
    return httpx.get(f"{server.url}/stats", timeout=10).json()[model].get("replica_requests", {})


def test_a_models_own_replicas_run_it_when_it_first_loads(configured: Server) -> None:
    assert httpx.get(f"{configured.url}/stats", timeout=10).json()["tales"]["state"] == "unloaded"
    with ThreadPoolExecutor(20) as pool:
        texts = list(pool.map(lambda _: _complete(configured, "tales"), range(20)))
    assert texts == [DOCUMENTED] * 20
    assert len(_replicas(configured, "tales")) == 2  # the model's replicas = 2, not the [server] autoscaler's one


def test_the_autoscaler_adds_a_replica_under_load_up_to_max(configured: Server) -> None:
    assert len(_replicas(configured, "stories")) <= 1  # min = 1: one replica until the load comes
    deadline = time.monotonic() + 150  # bounded: Ray Serve's autoscaler decides every few seconds
    with ThreadPoolExecutor(8) as pool:
        while len(_replicas(configured, "stories")) < 2:  # 8 ongoing requests, a target of 1 each: max (2)
            assert time.monotonic() < deadline, f"no second replica: {_replicas(configured, 'stories')}"
            texts = list(pool.map(lambda _: _complete(configured, "stories", 480), range(8)))
            assert all(t.startswith(DOCUMENTED) for t in texts)
    assert len(_replicas(configured, "stories")) == 2
