"""The config file's ``[server]`` table (``lmdock serve``): defaults, validation, schema, CLI help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from lmdock import ConfigError, ServerConfig, config_schema, load_config

MODEL = '[models.m]\nmodel = "org/model"\n'


def _load(tmp: Path, server: str) -> object:
    path = tmp / "lmdock.toml"
    path.write_text(f"[server]\n{server}\n{MODEL}")
    return load_config(path)


def test_defaults_bind_loopback_with_bounded_limits(isolated: Path) -> None:
    cfg = _load(isolated, "")
    assert cfg.server == ServerConfig()  # type: ignore[attr-defined]
    s = ServerConfig()
    assert (s.host, s.port, s.max_body_bytes, s.shutdown_timeout, s.cors_origins) == ("127.0.0.1", 8000, 1048576, 30.0, ())


def test_values_are_read(isolated: Path) -> None:
    cfg = _load(isolated, 'port = 9000\nmax_queue = 8\ncors_origins = ["http://localhost:3000"]\nshutdown_timeout = 5')
    assert cfg.server.port == 9000 and cfg.server.max_queue == 8  # type: ignore[attr-defined]
    assert cfg.server.cors_origins == ("http://localhost:3000",)  # type: ignore[attr-defined]
    assert cfg.server.metric_names == "lmdock"  # type: ignore[attr-defined]  # today's names unless asked
    assert _load(isolated, 'metric_names = "vllm"').server.metric_names == "vllm"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "key"), [
    ("port = 70000", "server.port"),
    ("port = 'x'", "server.port"),
    ("max_queue = 0", "server.max_queue"),
    ("shutdown_timeout = -1", "server.shutdown_timeout"),
    ("listen = 1", "server.listen"),
    ("memory_budget_gib = 0", "server.memory_budget_gib"),
    ("max_loaded_models = 0", "server.max_loaded_models"),
    ("metric_names = 'prometheus'", "server.metric_names"),
    ("replicas = 0", "server.replicas"),
    ("replicas = 2\nautoscaling = { max = 3 }", "server.autoscaling"),
    ("autoscaling = { min = 1 }", "server.autoscaling"),
    ("autoscaling = { max = 2, target_ongoing_requests = 0 }", "server.autoscaling.target_ongoing_requests"),
    ("ray_actor_options = { num_cpu = 1 }", "server.ray_actor_options"),
])
def test_mistakes_name_the_key(isolated: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(isolated, text)
    assert exc.value.key == key


def test_a_models_pool_keys_are_read_and_checked(isolated: Path) -> None:
    path = isolated / "lmdock.toml"
    path.write_text('[server]\nmemory_budget_gib = 1.5\nmax_loaded_models = 2\n'
                    '[models.a]\nmodel = "org/a"\nkeep_alive = 0\npin = true\n[models.b]\nmodel = "org/b"\npreload = true\n')
    cfg = load_config(path)
    assert (cfg.server.memory_budget_gib, cfg.server.max_loaded_models) == (1.5, 2)
    a, b = cfg.models["a"], cfg.models["b"]
    assert (a.keep_alive, a.pin, a.preload, b.keep_alive, b.pin, b.preload) == (0.0, True, False, -1.0, False, True)
    for bad, key in (("keep_alive = -2", "models.m.keep_alive"), ("pin = 1", "models.m.pin"), ("preload = 'yes'", "models.m.preload")):
        path.write_text(f"{MODEL}{bad}\n")
        with pytest.raises(ConfigError) as exc:
            load_config(path)
        assert exc.value.key == key, bad


def test_replica_keys_are_read_per_model_over_the_server_table(isolated: Path) -> None:
    from lmdock._models.replicas import replica_plan

    path = isolated / "lmdock.toml"
    path.write_text('[server]\nreplicas = 3\nray_actor_options = { num_cpus = 0.5 }\n'
                    '[models.a]\nmodel = "org/a"\nautoscaling = { min = 1, max = 4, target_ongoing_requests = 2 }\n'
                    'ray_actor_options = { num_gpus = 1 }\n[models.b]\nmodel = "org/b"\nreplicas = 2\n[models.c]\nmodel = "org/c"\n')
    cfg = load_config(path)
    a, b, c = (replica_plan(cfg.models[n], cfg.server, None) for n in "abc")
    assert a.autoscaling == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2} and a.num_replicas is None
    assert a.actor_options == {"num_cpus": 0.5, "num_gpus": 1} and a.cpus == 2.0
    assert (b.num_replicas, b.autoscaling, b.actor_options) == (2, None, {"num_cpus": 0.5})
    assert (c.num_replicas, c.on_ray) == (3, True)  # [server]'s count
    over = replica_plan(cfg.models["a"], cfg.server, 1)  # --replicas 1 over everything: no Ray
    assert (over.num_replicas, over.autoscaling, over.on_ray) == (1, None, False)
    for bad, key in (("replicas = 2\nautoscaling = { max = 2 }", "models.m.autoscaling"),
                     ("autoscaling = { min = 3, max = 2 }", "models.m.autoscaling"),
                     ("autoscaling = { min = 1, min_replicas = 1, max = 2 }", "models.m.autoscaling"),
                     ("ray_actor_options = { num_gpus = -1 }", "models.m.ray_actor_options.num_gpus"),
                     ("replicas = 0", "models.m.replicas")):
        path.write_text(f"{MODEL}{bad}\n")
        with pytest.raises(ConfigError) as exc:
            load_config(path)
        assert exc.value.key == key, bad
    jsonschema.validate({"models": {"m": {"model": "x", "replicas": 2, "ray_actor_options": {"num_cpus": 1}}}}, config_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"models": {"m": {"model": "x", "autoscaling": {"maxx": 2}}}}, config_schema())


def test_replica_keys_belong_to_the_server_not_to_an_llm(isolated: Path) -> None:
    from lmdock import LLM

    with pytest.raises(ConfigError, match="replicas: Ray Serve replicas are lmdock serve's"):
        LLM("org/a", replicas=2)


def test_schema_has_the_server_table(isolated: Path) -> None:
    schema = config_schema()
    assert "port" in schema["properties"]["server"]["properties"]
    jsonschema.validate({"server": {"port": 1, "cors_origins": ["x"]}, "models": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"server": {"nope": 1}}, schema)


def test_cli_help_describes_serve() -> None:
    out = subprocess.run([sys.executable, "-m", "lmdock", "--help"], capture_output=True, text=True).stdout
    assert "serve" in out and "OpenAI" in out
    out = subprocess.run([sys.executable, "-m", "lmdock", "serve", "--help"], capture_output=True, text=True).stdout
    assert "--api-key" in out and "[server]" in out
