"""``lmdock chat``: one message, or an interactive session, through the model's chat template."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lmdock._cli.options import model_args, open_llm, read_template
from lmdock._cli.printing import StreamPrinter, label, output_json
from lmdock._cli.sampling import add_sampling_args, sampling_overrides


def add_parser(sub: Any) -> None:
    """``lmdock chat``'s flags."""
    c = sub.add_parser("chat", help="chat with a model (one message, or interactive without one)")
    model_args(c)
    c.add_argument("message", nargs="?", help="the user message; omit for an interactive session")
    c.add_argument("--system", help="a system message")
    c.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file (for a model that has none)")
    add_sampling_args(c)
    c.add_argument("--stream", action="store_true", help="print the reply as it is generated")
    c.add_argument("--json", action="store_true", help="print the outputs as JSON (with --stream: JSON lines)")
    c.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    template = read_template(args.chat_template)
    if template is None:  # checked before the model is loaded where the files tell
        from lmdock._plugin.errors import RequestError
        from lmdock._plugin.loader import resolve_model

        mc = resolve_model(args.model, args.config, {"backend": args.backend} if args.backend else {})
        if _has_chat_template(Path(mc.tokenizer or mc.model)) is False:
            raise RequestError(NO_TEMPLATE.format(model=mc.model))
    with open_llm(args) as llm:
        if template is None and llm.tokenizer is not None and not getattr(llm.tokenizer, "chat_template", None):
            from lmdock._plugin.errors import RequestError

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
        printer = StreamPrinter(labelled, args.json, 1, params.n)
        last = None
        for last in llm.stream(ids, params):
            printer.snapshot(0, last)
        printer.end()
        return last.outputs[0].text if last is not None else ""
    out = llm.chat(messages, params, chat_template=template)[0]
    if args.json:
        print(json.dumps(output_json(out), indent=2))
    else:
        for comp in out.outputs:
            if labelled:
                print(label(0, comp.index, 1, params.n))
            print(comp.text)
    return out.outputs[0].text
