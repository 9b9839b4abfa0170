"""``lmdock serve``: the OpenAI- and Anthropic-compatible server, with vLLM's serve flags."""

from __future__ import annotations

import argparse
from typing import Any

from lmdock._cli.options import port, replica_count


def add_parser(sub: Any) -> None:
    """``lmdock serve``'s flags."""
    sv = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API (pip install 'lmdock[serve]')",
                        description="Serve the config file's models (the named ones, by default all of them, each loaded when a "
                        "request first names it under [server] max_loaded_models / memory_budget_gib) over "
                        "OpenAI's HTTP API: /v1/completions, /v1/chat/completions, /v1/responses, "
                        "/v1/responses/{response_id}, /v1/models, /v1/models/{id}, /v1/models/{id}/load, "
                        "/v1/models/{id}/unload, /v1/load_lora_adapter, /v1/unload_lora_adapter, /v1/embeddings, /v1/score and /score, /v1/rerank and /rerank, "
                        "/tokenize, /detokenize, /tokenizer_info, /health, /metrics, /stats; and Anthropic's "
                        "/v1/messages, /v1/messages/count_tokens. Settings come from the config's [server] table; "
                        "SIGTERM/SIGINT drain the requests in flight, then exit 0. See docs/server.md.")
    sv.add_argument("model", nargs="?", metavar="MODEL_OR_PATH",
                    help="a model name in the config file, a local path or a hub id (as `vllm serve MODEL`)")
    sv.add_argument("-m", "--model", action="append", dest="models", metavar="MODEL",
                    help="a model name in the config file, loaded at start (repeatable; default: every model of the config)")
    # vLLM's flags, as `vllm serve` users type them, onto lmdock's portable config
    sv.add_argument("--served-model-name", metavar="NAME", help="the name clients use for the (one) model")
    sv.add_argument("--max-model-len", type=int, metavar="N", help="context length: [models.NAME.build] max_seq_len")
    sv.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="[models.NAME.build] dtype")
    sv.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N", help="[models.NAME.build] tensor_parallel_size")
    sv.add_argument("--gpu-memory-utilization", type=float, metavar="F", help="[models.NAME.kv_cache] memory_fraction")
    sv.add_argument("--speculative-config", metavar="JSON", help="speculative decoding, as vLLM takes it: [models.NAME.speculative] "
                    "(e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'; docs/speculative.md)")
    sv.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    sv.add_argument("--backend", help="backend name or 'auto' (overrides the config file)")
    sv.add_argument("--host", help="address to bind (default: [server] host, 127.0.0.1)")
    sv.add_argument("--port", type=port, help="port (default: [server] port, 8000)")
    sv.add_argument("--api-key", help="require this key (default: $LMDOCK_API_KEY, then [server] api_key_file / api_key)")
    sv.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file for /v1/chat/completions")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--replicas", type=replica_count, metavar="N",
                    help="run each model's engine as N Ray Serve replicas behind this server, over the config's "
                         "replicas / autoscaling (1: no Ray); needs pip install 'lmdock[ray]'")
    sv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from lmdock.server import serve
    except ImportError as exc:
        from lmdock._plugin.errors import LmdockError as _E

        raise _E(f"lmdock serve needs the server extra ({exc.name} is missing): pip install 'lmdock[serve]'") from None
    models = ([args.model] if args.model else []) + (args.models or [])
    return serve(models, args.config, host=args.host, port=args.port, api_key=args.api_key, backend=args.backend,
                 chat_template=args.chat_template, log_level=args.log_level, options=vllm_options(args),
                 served_name=args.served_model_name, replicas=args.replicas)


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's serve flags as ``LLM(...)`` options (the config's sections, field by field)."""
    build = {k: v for k, v in (("max_seq_len", args.max_model_len), ("dtype", args.dtype),
                               ("tensor_parallel_size", args.tensor_parallel_size)) if v is not None}
    options: dict[str, Any] = {"build": build} if build else {}
    if args.gpu_memory_utilization is not None:
        options["kv_cache"] = {"memory_fraction": args.gpu_memory_utilization}
    if args.speculative_config is not None:
        from lmdock._config.speculative import parse_json

        options["speculative"] = parse_json(args.speculative_config)
    return options
