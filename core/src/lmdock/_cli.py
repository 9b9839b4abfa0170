"""The ``lmdock`` command.  User mistakes print one clear line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from lmdock._errors import LmdockError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LmdockError as exc:
        print(f"lmdock: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmdock", description="Run LLMs on any inference engine.")
    sub = p.add_subparsers(metavar="COMMAND")

    b = sub.add_parser("backends", help="list installed backends, their state and capabilities")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=cmd_backends)

    g = sub.add_parser("generate", help="generate text for prompts")
    _model_args(g)
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    _sampling_args(g)
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="print the outputs as JSON")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with a model (one message, or interactive without one)")
    _model_args(c)
    c.add_argument("message", nargs="?", help="the user message; omit for an interactive session")
    c.add_argument("--system", help="a system message")
    c.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file")
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API (pip install 'lmdock[serve]')",
                        description="Serve the config file's models (the named ones, by default default_model) over "
                        "OpenAI's HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /v1/embeddings, /tokenize, "
                        "/detokenize, /tokenizer_info, /health, /metrics. Settings come from the config's [server] table; "
                        "SIGTERM/SIGINT drain the requests in flight, then exit 0. See docs/server.md.")
    sv.add_argument("-m", "--model", action="append", dest="models", metavar="MODEL",
                    help="a model name in the config file (repeatable; default: the config's default_model)")
    sv.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    sv.add_argument("--backend", help="backend name or 'auto' (overrides the config file)")
    sv.add_argument("--host", help="address to bind (default: [server] host, 127.0.0.1)")
    sv.add_argument("--port", type=int, help="port (default: [server] port, 8000)")
    sv.add_argument("--api-key", help="require this key (default: $LMDOCK_API_KEY, then [server] api_key_file / api_key)")
    sv.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file for /v1/chat/completions")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)

    cfg = sub.add_parser("config", help="check the config file or print its JSON Schema")
    csub = cfg.add_subparsers(metavar="ACTION")
    ck = csub.add_parser("check", help="validate the config file, with every installed backend's options")
    ck.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    ck.set_defaults(func=cmd_config_check)
    sc = csub.add_parser("schema", help="print the config file's JSON Schema (for editors)")
    sc.set_defaults(func=cmd_config_schema)
    cfg.set_defaults(func=lambda a: cfg.print_help() or 2)
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="model name in the config file, a local path or a hub id (default: the config's default model)")
    p.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    p.add_argument("--backend", help="backend name or 'auto' (overrides the config file)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--min-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("-n", type=int, dest="n")
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "n", "stop", "ignore_eos")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _llm(args: argparse.Namespace) -> Any:
    from lmdock._llm import LLM

    return LLM(args.model, backend=args.backend, config=args.config)


def cmd_backends(args: argparse.Namespace) -> int:
    from lmdock._contract import CAPABILITIES
    from lmdock._plugins import get_registry

    reg = get_registry()
    rows = []
    for spec in sorted(reg.backends.values(), key=lambda s: s.name):
        reason = spec.available()
        rows.append({
            "name": spec.name, "plugin": spec.plugin, "package": spec.package, "version": spec.version, "kind": spec.kind,
            "status": "available" if reason is None else "unavailable", "reason": reason,
            "engine": spec.engine_info() if reason is None else None,
            "capabilities": sorted(c for c in CAPABILITIES if c in spec.supports),
            "lacks": {c: spec.capability(c)[1] for c in CAPABILITIES if c not in spec.supports},
        })
    for b in sorted(reg.broken.values(), key=lambda b: b.name):
        rows.append({"name": b.name, "plugin": b.name, "package": b.distribution, "version": None, "kind": None,
                     "status": "broken", "reason": b.error, "capabilities": [], "lacks": {}})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no backends installed; pip install lmdock-hf (or lmdock-onnx, lmdock-mlx, lmdock-vllm, lmdock-trtllm)")
        return 0
    print(f"{'BACKEND':<10} {'PACKAGE':<16} {'VERSION':<9} {'KIND':<8} STATUS")
    for r in rows:
        status = r["status"] if r["reason"] is None else f"{r['status']}: {r['reason']}"
        if r.get("engine"):
            status += f" ({r['engine']})"
        print(f"{r['name']:<10} {r['package'] or '-':<16} {r['version'] or '-':<9} {r['kind'] or '-':<8} {status}")
        if r["capabilities"]:
            print(f"{'':<10} supports: {', '.join(r['capabilities'])}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    with _llm(args) as llm:
        params = llm._params(_overrides(args))
        if args.stream:
            for prompt in args.prompts:
                sent = 0
                for out in llm.stream(prompt, params):
                    text = out.outputs[0].text
                    sys.stdout.write(text[sent:])
                    sys.stdout.flush()
                    sent = len(text)
                sys.stdout.write("\n")
            return 0
        outputs = llm.generate(args.prompts, params)
        if args.json:
            print(json.dumps([_output_json(o) for o in outputs], indent=2))
            return 0
        for out in outputs:
            for comp in out.outputs:
                print(comp.text)
    return 0


def _output_json(out: Any) -> dict[str, Any]:
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "outputs": [
            {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in out.outputs
        ],
    }


def cmd_chat(args: argparse.Namespace) -> int:
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as exc:
            from lmdock._errors import ConfigError

            raise ConfigError(f"cannot read chat template: {exc.strerror}", source=args.chat_template) from None
    with _llm(args) as llm:
        params = llm._params(_overrides(args))
        messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            print(llm.chat(messages, params, chat_template=template)[0].outputs[0].text)
            return 0
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            messages.append({"role": "user", "content": line})
            reply = llm.chat(messages, params, chat_template=template)[0].outputs[0].text
            print(reply)
            messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from lmdock.server import serve
    except ImportError as exc:
        from lmdock._errors import LmdockError as _E

        raise _E(f"lmdock serve needs the server extra ({exc.name} is missing): pip install 'lmdock[serve]'") from None
    return serve(args.models, args.config, host=args.host, port=args.port, api_key=args.api_key, backend=args.backend,
                 chat_template=args.chat_template, log_level=args.log_level)


def cmd_config_check(args: argparse.Namespace) -> int:
    from lmdock._config import find_config, load_config
    from lmdock._plugins import get_registry
    from lmdock._schema import build

    path = find_config(args.config)
    if path is None:
        from lmdock._errors import ConfigError

        raise ConfigError("no config file found (looked for --config, $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    cfg = load_config(path)
    reg = get_registry()
    notes = []
    for name, mc in cfg.models.items():
        for bname, opts in mc.backends.items():
            spec = reg.backends.get(bname)
            if spec is None:
                notes.append(f"models.{name}.backends.{bname}: backend not installed here; its options were not checked")
            elif spec.options is not None:
                build(spec.options, opts, source=cfg.path, prefix=f"models.{name}.backends.{bname}")
    print(f"{cfg.path}: OK ({len(cfg.models)} model{'s' if len(cfg.models) != 1 else ''}: {', '.join(cfg.models)})")
    for n in notes:
        print(f"note: {n}")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    from lmdock._config import config_schema
    from lmdock._plugins import get_registry

    options = {s.name: s.options for s in get_registry().backends.values() if s.options is not None}
    print(json.dumps(config_schema(options), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
