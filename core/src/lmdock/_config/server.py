"""The ``[server]`` table, and the Ray Serve replica tables a model or ``[server]`` may carry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lmdock._config.base import Replaceable, in_range, integer
from lmdock._config.schema import check

#: Ray Serve's ``autoscaling_config`` keys that ``autoscaling`` takes (``min`` and ``max`` are short for
#: ``min_replicas`` and ``max_replicas``), and its ``ray_actor_options`` keys that ``ray_actor_options`` takes
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests", "upscale_delay_s",
                    "downscale_delay_s")
ACTOR_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")


def replica_tables(replicas: int | None, autoscaling: dict[str, Any] | None,
                   actor: dict[str, Any] | None) -> dict[str, Any] | None:
    """Check a table's ``replicas``, ``autoscaling`` and ``ray_actor_options`` (``lmdock serve`` on Ray
    Serve, ``server/_ray.py``); return ``autoscaling`` with ``min`` / ``max`` spelt as Ray does."""
    integer("replicas", replicas, 1)
    for key, value in (actor or {}).items():
        check(key in ACTOR_KEYS, "ray_actor_options", f"unknown key {key!r}; known: {', '.join(ACTOR_KEYS)}")
        if key in ("num_cpus", "num_gpus"):
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, f"ray_actor_options.{key}",
                  f"must be a number >= 0, got {value!r}")
        elif key == "memory":
            integer("ray_actor_options.memory", value, 1, optional=False)
        elif key == "resources":
            check(isinstance(value, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in value.values()),
                  "ray_actor_options.resources", f"must be a table of custom resource amounts, got {value!r}")
        else:
            check(isinstance(value, str) and bool(value), "ray_actor_options.accelerator_type",
                  f"must be a Ray accelerator type such as 'A100', got {value!r}")
    if autoscaling is None:
        return None
    check(replicas is None, "autoscaling", "give replicas (a fixed count) or autoscaling, not both")
    table = {}
    for key, value in autoscaling.items():
        full = {"min": "min_replicas", "max": "max_replicas"}.get(key, key)
        check(full in AUTOSCALING_KEYS, "autoscaling", f"unknown key {key!r}; known: min, max, {', '.join(AUTOSCALING_KEYS)}")
        check(full not in table, "autoscaling", f"{key!r} and {full!r} say the same; give one")
        table[full] = value
    for key in ("min_replicas", "max_replicas", "initial_replicas"):
        integer(f"autoscaling.{key}", table.get(key), 0 if key != "max_replicas" else 1)
    check("max_replicas" in table, "autoscaling", "needs max (the most replicas to scale to)")
    check(table.get("min_replicas", 1) <= table["max_replicas"], "autoscaling",
          f"min ({table.get('min_replicas')}) is above max ({table['max_replicas']})")
    for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
        value = table.get(key)
        check(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0),
              f"autoscaling.{key}", f"must be a number >= 0, got {value!r}")
    check(table.get("target_ongoing_requests", 1) > 0, "autoscaling.target_ongoing_requests", "must be > 0")
    return table


@dataclass(frozen=True)
class ServerConfig(Replaceable):
    """The ``[server]`` table: how ``lmdock serve`` listens, whom it lets in and how much it takes.

    The API key comes from ``--api-key``, else ``$LMDOCK_API_KEY``, else ``api_key_file`` (its first
    line), else ``api_key`` (write ``"${env.VAR}"`` rather than the key itself); with none, no key is
    asked for.  ``max_queue`` bounds each model's sequences in flight (running and waiting; a request
    counts its prompts x ``n`` (or beams)); by default it is the model's ``scheduler.max_num_seqs +
    scheduler.max_waiting``.  ``max_n``, ``max_logprobs`` (vLLM's default, and OpenAI's top_logprobs
    bound), ``max_stop_strings`` and ``max_stop_length`` bound the work one request may ask for;
    ``template_timeout`` and ``max_prompt_chars`` bound a chat template's render (``server/_templates.py``).
    ``memory_budget_gib`` and ``max_loaded_models`` bound the models loaded at once (``server/_pool.py``):
    the least recently used idle model is unloaded to make room; None is no bound.
    ``max_header_bytes``, ``max_headers``, ``header_timeout``, ``keep_alive_timeout`` and
    ``max_connections`` bound what a connection may cost before any route runs (``server/_http.py``).
    ``metric_names = "vllm"`` also exports the engine gauges under vLLM's ``vllm:`` names, which the
    Gateway API Inference Extension (llm-d, KServe) reads from a model server (``server/_metrics.py``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None
    max_body_bytes: int = 1048576
    max_queue: int | None = None
    retry_after: int = 1
    cors_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0
    chat_template: str | None = None
    max_n: int = 128
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_length: int = 1024
    #: a request's own ``chat_template`` (a program the client sends) is refused unless this is on
    trust_request_chat_template: bool = False
    #: ``/v1/load_lora_adapter`` (a client names a folder on this machine) is refused unless this is on
    #: (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
    allow_runtime_lora_updating: bool = False
    #: the Responses API's store of recent responses (``previous_response_id``), bounded in bytes of
    #: compact JSON and in count; the least recently used response goes first (``server/_response_store.py``)
    response_store_max_bytes: int = 134_217_728
    response_store_max_items: int = 1024
    template_timeout: float = 5.0
    max_prompt_chars: int = 4_194_304
    memory_budget_gib: float | None = None
    max_loaded_models: int | None = None
    max_header_bytes: int = 32768
    max_headers: int = 100
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 512
    metric_names: Literal["lmdock", "vllm"] = "lmdock"
    #: a ``max_tokens`` past what the context leaves after the prompt, on the OpenAI routes (completions,
    #: chat): ``"refuse"`` (a 400 naming the room left, as vLLM answers) or ``"clamp"`` (cut to the room, the
    #: finish reason ``length`` when reached).  ``/v1/messages`` and ``/v1/responses`` always clamp: agent
    #: clients send a large ``max_tokens`` whatever the model's context (as llama.cpp and Ollama clamp).
    max_tokens_past_context: Literal["refuse", "clamp"] = "refuse"
    #: images in requests (docs/vision.md): at most ``max_images_per_request`` a request, each at most
    #: ``max_image_pixels`` (read from its header, before decoding); file paths only under ``image_dir``
    #: (None: none read); http(s) URLs only with ``image_fetch`` on (``server/_fetch.py``): at most
    #: ``image_fetch_max_bytes`` in ``image_fetch_timeout`` seconds, never from a private, loopback or
    #: link-local address unless its network is in ``image_fetch_allow``
    max_images_per_request: int = 8
    max_image_pixels: int = 16_777_216
    image_dir: str | None = None
    image_fetch: bool = False
    image_fetch_max_bytes: int = 20_971_520
    image_fetch_timeout: float = 10.0
    image_fetch_allow: tuple[str, ...] = ()
    #: each model's engine as this many Ray Serve replicas behind the one server (1: no Ray; ``server/_ray.py``),
    #: or as many as Ray Serve's autoscaler keeps between ``autoscaling``'s min and max; each replica an actor
    #: with ``ray_actor_options`` (``num_cpus`` 1 unless given).  A model's own keys win over these.
    replicas: int = 1
    autoscaling: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins or ()))
        in_range("memory_budget_gib", self.memory_budget_gib, 0.0, lo_open=True)
        integer("max_loaded_models", self.max_loaded_models, 1)
        for name in ("max_n", "max_stop_strings", "max_stop_length"):
            integer(name, getattr(self, name), 1, optional=False)
        integer("max_logprobs", self.max_logprobs, 0, optional=False)
        integer("max_prompt_chars", self.max_prompt_chars, 1, optional=False)
        integer("max_images_per_request", self.max_images_per_request, 1, optional=False)
        integer("max_image_pixels", self.max_image_pixels, 1, optional=False)
        self._check_image_fetch()
        integer("response_store_max_bytes", self.response_store_max_bytes, 0, optional=False)
        integer("response_store_max_items", self.response_store_max_items, 0, optional=False)
        for name in ("max_header_bytes", "max_headers", "max_connections"):
            integer(name, getattr(self, name), 1, optional=False)
        for name in ("header_timeout", "keep_alive_timeout"):
            check(getattr(self, name) > 0, name, f"must be > 0 seconds, got {getattr(self, name)}")
        check(self.template_timeout > 0, "template_timeout", f"must be > 0 seconds, got {self.template_timeout}")
        check(bool(self.host), "host", "must be a host name or address, such as '127.0.0.1'")
        integer("port", self.port, 0, optional=False)
        check(self.port <= 65535, "port", f"must be <= 65535, got {self.port}")
        integer("max_body_bytes", self.max_body_bytes, 1, optional=False)
        integer("max_queue", self.max_queue, 1)
        integer("retry_after", self.retry_after, 1, optional=False)
        in_range("shutdown_timeout", self.shutdown_timeout, 0.0)
        check(self.api_key is None or self.api_key != "", "api_key", "is empty; remove it or give a key")
        integer("replicas", self.replicas, 1, optional=False)
        object.__setattr__(self, "autoscaling", replica_tables(None if self.replicas == 1 else self.replicas,
                                                               self.autoscaling, self.ray_actor_options))
        check(self.max_tokens_past_context in ("refuse", "clamp"), "max_tokens_past_context",
              f"must be 'refuse' (a 400, as vLLM answers) or 'clamp' (cut to the context), got {self.max_tokens_past_context!r}")
        check(self.metric_names in ("lmdock", "vllm"), "metric_names",
              f"must be 'lmdock' (lmdock: names only) or 'vllm' (also vLLM's vllm: names), got {self.metric_names!r}")

    def _check_image_fetch(self) -> None:
        import ipaddress

        integer("image_fetch_max_bytes", self.image_fetch_max_bytes, 1, optional=False)
        check(self.image_fetch_timeout > 0, "image_fetch_timeout", f"must be > 0 seconds, got {self.image_fetch_timeout}")
        allow = self.image_fetch_allow
        check(isinstance(allow, (list, tuple)) and all(isinstance(v, str) for v in allow), "image_fetch_allow",
              f"must be a list of networks such as ['10.0.0.0/8'], got {allow!r}")
        for value in allow:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                check(False, "image_fetch_allow", f"{value!r} is not an IP network; give addresses or networks such as '10.1.2.0/24'")
        object.__setattr__(self, "image_fetch_allow", tuple(allow))
