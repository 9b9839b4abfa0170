"""The ``lmdock`` command.  User mistakes print one clear line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmdock._cli_parser import Parser
from lmdock._cli_sampling import add_sampling_args, sampling_overrides
from lmdock._errors import LmdockError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None:  # the `lmdock` command itself (tests call main([...]) in-process)
        _quiet_engines()
    try:
        code = int(args.func(args) or 0)
    except LmdockError as exc:
        print(f"lmdock: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        return _interrupted(hard=argv is None)
    if argv is None:
        # The command's work is done: a Ctrl-C landing now could only interrupt the interpreter's
        # teardown (torch's atexit handlers printed "Exception ignored ... KeyboardInterrupt").
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _interrupted(hard: bool) -> int:
    """Ctrl-C: stop every engine in order, then exit 130.

    The ``with`` blocks have already shut the LLM down as the interrupt unwound; this is the backstop
    for an interrupt that landed while an LLM was being built or closed.  The command then leaves with
    ``os._exit``: an engine's native threads (torch's pools...) must not meet the interpreter's and
    C++'s teardown, which is what aborted with "terminate called without an active exception" (134).
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the shutdown
    llm_module = sys.modules.get("lmdock._llm")
    if llm_module is not None:
        llm_module.shutdown_all()
    if not hard:
        return 130
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(130)


def _quiet_engines() -> None:
    """No transformers "Loading weights" bar or token-length warning, no torchao import chatter, in a
    CLI run (set the variables yourself to see the transformers ones)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # transformers imports torchao when it is installed (lmdock-hf[quant]), which logs the native
    # kernels it cannot load here and a torch pytree deprecation at import: warnings, not errors
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _parser() -> Parser:
    p = Parser(prog="lmdock", description="Run LLMs on any inference engine.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(metavar="COMMAND")

    b = sub.add_parser("backends", help="list installed backends, their state and capabilities")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=cmd_backends)

    g = sub.add_parser("generate", help="generate text for prompts")
    _model_args(g)
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_sampling_args(g)
    g.add_argument("--stream", action="store_true",
                   help="print text as it is generated (with several prompts or -n > 1, each completion is labelled)")
    g.add_argument("--json", action="store_true",
                   help="print the outputs as JSON (with --stream: one JSON object per line for each piece of text)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with a model (one message, or interactive without one)")
    _model_args(c)
    c.add_argument("message", nargs="?", help="the user message; omit for an interactive session")
    c.add_argument("--system", help="a system message")
    c.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file (for a model that has none)")
    add_sampling_args(c)
    c.add_argument("--stream", action="store_true", help="print the reply as it is generated")
    c.add_argument("--json", action="store_true", help="print the outputs as JSON (with --stream: JSON lines)")
    c.set_defaults(func=cmd_chat)

    bt = sub.add_parser(
        "batch", help="run an OpenAI-style batch file (JSONL) and write one result line per input",
        description="Run every line of INPUT (OpenAI batch-file lines: custom_id, url /v1/completions, "
        "/v1/chat/completions or /v1/embeddings, and body) and append one result line per input to OUTPUT, "
        "flushed as each finishes. Every line needs a custom_id of its own: lines whose custom_id is already in "
        "OUTPUT are skipped, so an interrupted run resumes where it stopped; a bad line becomes an error line "
        "of its own. See docs/cli.md.")
    bt.add_argument("input", metavar="INPUT.jsonl")
    bt.add_argument("output", metavar="OUTPUT.jsonl")
    _model_args(bt)
    bt.add_argument("--chat-template", metavar="FILE",
                    help="a Jinja chat template file for the /v1/chat/completions lines (as lmdock serve's)")
    bt.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    bt.set_defaults(func=cmd_batch)
    e = sub.add_parser("embed", help="print embeddings of texts as JSON (an embedding model)")
    _model_args(e)
    e.add_argument("texts", nargs="+", metavar="TEXT")
    e.add_argument("--dimensions", type=int, help="keep the first N values (Matryoshka), then normalize")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None, help="unit-length vectors (default: the model's)")
    e.add_argument("--truncate", type=int, metavar="N", help="cut longer texts to N tokens (-1: the model's maximum)")
    e.set_defaults(func=cmd_embed)
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
    sv.add_argument("--port", type=_port, help="port (default: [server] port, 8000)")
    sv.add_argument("--api-key", help="require this key (default: $LMDOCK_API_KEY, then [server] api_key_file / api_key)")
    sv.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file for /v1/chat/completions")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--replicas", type=_replicas, metavar="N",
                    help="run each model's engine as N Ray Serve replicas behind this server, over the config's "
                         "replicas / autoscaling (1: no Ray); needs pip install 'lmdock[ray]'")
    sv.set_defaults(func=cmd_serve)

    cfg = sub.add_parser("config", help="check the config file or print its JSON Schema")
    csub = cfg.add_subparsers(metavar="ACTION")
    ck = csub.add_parser("check", help="validate the config file, with every installed backend's options")
    ck.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    ck.set_defaults(func=cmd_config_check)
    sc = csub.add_parser("schema", help="print the config file's JSON Schema (for editors)")
    sc.set_defaults(func=cmd_config_schema)
    cfg.set_defaults(func=lambda a: cfg.print_help() or 2)
    p.commands = sub.choices
    return p


def _port(value: str) -> int:
    """A TCP port number, 0 to 65535 (0: any free port)."""
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port: give a number from 0 to 65535")
    return int(value)


def _replicas(value: str) -> int:
    """A replica count, 1 or more."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a replica count: give a number from 1 (1: no Ray)")
    return int(value)


def _model_args(p: Parser) -> None:
    p.add_argument("-m", "--model", help="model name in the config file, a local path or a hub id (default: the config's default model)")
    p.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    p.add_argument("--backend", help="backend name or 'auto' (overrides the config file)")


def _llm(args: argparse.Namespace) -> Any:
    from lmdock._llm import LLM

    return LLM(args.model, backend=args.backend, config=args.config)


def cmd_backends(args: argparse.Namespace) -> int:
    from lmdock._plugins import plugin_filter_note

    rows, engine_lines = _backend_rows()
    note = plugin_filter_note()
    if note:
        print(f"lmdock: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_backends(rows, engine_lines, note)
    sys.stdout.flush()  # the warnings come last, under the table, where the eye lands
    for r in rows:  # an engine outside its tested range: a warning, not a refusal (issue 26)
        for warning in r["warnings"]:
            print(f"lmdock: warning: {warning}", file=sys.stderr)
    return 0


def _print_backends(rows: list[dict[str, Any]], engine_lines: list[list[str]], note: str | None) -> None:
    if not rows:
        if note is None:
            print("no backends installed; pip install lmdock-hf (or lmdock-onnx, lmdock-mlx, lmdock-vllm, lmdock-trtllm)")
        else:
            print("no backends loaded")
        return
    print(f"{'BACKEND':<10} {'PACKAGE':<16} {'VERSION':<9} {'KIND':<8} STATUS")
    for r, lines in zip(rows, engine_lines):
        status = r["status"] if r["reason"] is None else f"{r['status']}: {r['reason']}"
        if r.get("engine"):
            status += f" ({r['engine']})"
        print(f"{r['name']:<10} {r['package'] or '-':<16} {r['version'] or '-':<9} {r['kind'] or '-':<8} {status}")
        for line in lines:
            print(f"{'':<10} engine: {line}")
        if r["capabilities"]:
            print(f"{'':<10} supports: {', '.join(r['capabilities'])}")


def _backend_rows() -> tuple[list[dict[str, Any]], list[list[str]]]:
    """``lmdock backends --json``'s rows, and each row's "engine:" lines for the text listing."""
    from lmdock._contract import CAPABILITIES
    from lmdock._plugins import get_registry
    from lmdock._versions import report

    reg = get_registry()
    rows: list[dict[str, Any]] = []
    engine_lines: list[list[str]] = []
    for spec in sorted(reg.backends.values(), key=lambda s: s.name):
        reason = spec.available()
        engines, warnings = report(spec)
        rows.append({
            "name": spec.name, "plugin": spec.plugin, "package": spec.package, "version": spec.version, "kind": spec.kind,
            "status": "available" if reason is None else "unavailable", "reason": reason,
            "engine": spec.engine_info() if reason is None else None,
            "engine_packages": [e.as_json() for e in engines], "warnings": warnings,
            "capabilities": sorted(c for c in CAPABILITIES if c in spec.supports),
            "lacks": {c: spec.capability(c)[1] for c in CAPABILITIES if c not in spec.supports},
        })
        engine_lines.append([e.describe() for e in engines if e.version is not None])
    for b in sorted(reg.broken.values(), key=lambda b: b.name):
        rows.append({"name": b.name, "plugin": b.name, "package": b.distribution, "version": None, "kind": None,
                     "status": "broken", "reason": b.error, "engine_packages": [], "warnings": [],
                     "capabilities": [], "lacks": {}})
        engine_lines.append([])
    return rows, engine_lines


def _version() -> str:
    from lmdock import __version__

    return f"lmdock {__version__} (Python {sys.version.split()[0]})"


def cmd_generate(args: argparse.Namespace) -> int:
    with _llm(args) as llm:
        params = llm.sampling_params(sampling_overrides(args))
        labelled = len(args.prompts) > 1 or params.n > 1
        if args.stream:
            printer = _StreamPrinter(labelled, args.json, len(args.prompts), params.n)
            for p, prompt in enumerate(args.prompts):
                for out in llm.stream(prompt, params):
                    printer.snapshot(p, out)
            printer.end()
            return 0
        outputs = llm.generate(args.prompts, params)
        if args.json:
            print(json.dumps([_output_json(o) for o in outputs], indent=2))
            return 0
        for p, out in enumerate(outputs):
            for comp in out.outputs:
                if labelled:
                    print(_label(p, comp.index, len(args.prompts), params.n))
                print(comp.text)
    return 0


def _label(prompt: int, index: int, prompts: int, n: int) -> str:
    parts = ([f"prompt {prompt}"] if prompts > 1 else []) + ([f"completion {index}"] if n > 1 else [])
    return f"=== {', '.join(parts)} ==="


class _StreamPrinter:
    """Prints the new text of streaming snapshots.  One completion: the bare text.  Several (prompts or
    ``-n``): each piece under its completion's label, repeated whenever the output switches completion.
    JSON: one object per line per piece, ``{"prompt", "index", "text", "finish_reason"}``."""

    def __init__(self, labelled: bool, as_json: bool, prompts: int = 1, n: int = 1) -> None:
        self.labelled = labelled
        self.prompts, self.n = prompts, n
        self.as_json = as_json
        self.sent: dict[tuple[int, int], int] = {}
        self.finished: set[tuple[int, int]] = set()
        self.current: tuple[int, int] | None = None

    def snapshot(self, prompt: int, out: Any) -> None:
        for comp in out.outputs:
            key = (prompt, comp.index)
            sent = self.sent.get(key, 0)
            delta = comp.text[sent:]
            done = comp.finish_reason is not None and key not in self.finished
            if not delta and not done:
                continue
            self.sent[key] = len(comp.text)
            if done:
                self.finished.add(key)
            if self.as_json:
                sys.stdout.write(json.dumps({"prompt": prompt, "index": comp.index, "text": delta, "finish_reason": comp.finish_reason}) + "\n")
            elif delta:
                if self.labelled and key != self.current:
                    sys.stdout.write(("\n" if self.current is not None else "") + _label(prompt, comp.index, self.prompts, self.n).strip("= ").join("[]") + " ")
                self.current = key
                sys.stdout.write(delta)
        sys.stdout.flush()

    def end(self) -> None:
        if not self.as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()


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


NO_TEMPLATE = "model {model!r} has no chat template: pass --chat-template FILE (a Jinja template), or use `lmdock generate`"


def _has_chat_template(folder: Path) -> bool | None:
    """Whether a local model folder ships a chat template; None when it cannot be told before loading."""
    if not folder.is_dir():
        return None
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return None
def cmd_embed(args: argparse.Namespace) -> int:
    from lmdock._params import PoolingParams
    from lmdock._schema import build

    fields = {"normalize": args.normalize, "dimensions": args.dimensions, "truncate_prompt_tokens": args.truncate}
    params = build(PoolingParams, {k: v for k, v in fields.items() if v is not None}, source="<command line>")
    with _llm(args) as llm:
        outputs = llm.embed(args.texts, params)
    data = [{"index": i, "text": t, "prompt_token_ids": o.prompt_token_ids, "embedding": o.outputs.embedding}
            for i, (t, o) in enumerate(zip(args.texts, outputs))]
    print(json.dumps(data, ensure_ascii=False))
    return 0


def _read_template(path: str | None) -> str | None:
    """The text of a ``--chat-template FILE``, or None without one."""
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        from lmdock._errors import ConfigError

        raise ConfigError(f"cannot read the chat template: {exc.strerror}", source=path) from None


def cmd_chat(args: argparse.Namespace) -> int:
    template = _read_template(args.chat_template)
    if template is None:  # checked before the model is loaded where the files tell
        from lmdock._errors import RequestError
        from lmdock._loader import resolve_model

        mc = resolve_model(args.model, args.config, {"backend": args.backend} if args.backend else {})
        if _has_chat_template(Path(mc.tokenizer or mc.model)) is False:
            raise RequestError(NO_TEMPLATE.format(model=mc.model))
    with _llm(args) as llm:
        if template is None and llm.tokenizer is not None and not getattr(llm.tokenizer, "chat_template", None):
            from lmdock._errors import RequestError

            raise RequestError(NO_TEMPLATE.format(model=llm.model_config.model))
        params = llm.sampling_params(sampling_overrides(args))
        messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            _chat_turn(llm, messages, params, template, args)
            return 0
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            messages.append({"role": "user", "content": line})
            reply = _chat_turn(llm, messages, params, template, args)
            messages.append({"role": "assistant", "content": reply})


def _chat_turn(llm: Any, messages: list[dict[str, str]], params: Any, template: str | None, args: argparse.Namespace) -> str:
    """One reply: printed (streamed, labelled for -n > 1, or JSON); returns completion 0's text."""
    labelled = params.n > 1
    if args.stream:
        prompt = llm.render_chat(messages, template)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote BOS itself
        printer = _StreamPrinter(labelled, args.json, 1, params.n)
        last = None
        for last in llm.stream(ids, params):
            printer.snapshot(0, last)
        printer.end()
        return last.outputs[0].text if last is not None else ""
    out = llm.chat(messages, params, chat_template=template)[0]
    if args.json:
        print(json.dumps(_output_json(out), indent=2))
    else:
        for comp in out.outputs:
            if labelled:
                print(_label(0, comp.index, 1, params.n))
            print(comp.text)
    return out.outputs[0].text


def cmd_batch(args: argparse.Namespace) -> int:
    from lmdock._batch import run_batch

    return run_batch(args, _read_template(args.chat_template))


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from lmdock.server import serve
    except ImportError as exc:
        from lmdock._errors import LmdockError as _E

        raise _E(f"lmdock serve needs the server extra ({exc.name} is missing): pip install 'lmdock[serve]'") from None
    models = ([args.model] if args.model else []) + (args.models or [])
    return serve(models, args.config, host=args.host, port=args.port, api_key=args.api_key, backend=args.backend,
                 chat_template=args.chat_template, log_level=args.log_level, options=_vllm_options(args),
                 served_name=args.served_model_name, replicas=args.replicas)


def _vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's serve flags as ``LLM(...)`` options (the config's sections, field by field)."""
    build = {k: v for k, v in (("max_seq_len", args.max_model_len), ("dtype", args.dtype),
                               ("tensor_parallel_size", args.tensor_parallel_size)) if v is not None}
    options: dict[str, Any] = {"build": build} if build else {}
    if args.gpu_memory_utilization is not None:
        options["kv_cache"] = {"memory_fraction": args.gpu_memory_utilization}
    if args.speculative_config is not None:
        from lmdock._speculative import parse_json

        options["speculative"] = parse_json(args.speculative_config)
    return options


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
