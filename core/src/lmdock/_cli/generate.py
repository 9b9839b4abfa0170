"""``lmdock generate``: text for prompts, printed plain, labelled, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lmdock._cli.options import model_args, open_llm
from lmdock._cli.printing import StreamPrinter, label, output_json
from lmdock._cli.sampling import add_sampling_args, sampling_overrides


def add_parser(sub: Any) -> None:
    """``lmdock generate``'s flags."""
    g = sub.add_parser("generate", help="generate text for prompts")
    model_args(g)
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_sampling_args(g)
    g.add_argument("--stream", action="store_true",
                   help="print text as it is generated (with several prompts or -n > 1, each completion is labelled)")
    g.add_argument("--json", action="store_true",
                   help="print the outputs as JSON (with --stream: one JSON object per line for each piece of text)")
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_llm(args) as llm:
        params = llm.sampling_params(sampling_overrides(args))
        labelled = len(args.prompts) > 1 or params.n > 1
        if args.stream:
            printer = StreamPrinter(labelled, args.json, len(args.prompts), params.n)
            for p, prompt in enumerate(args.prompts):
                for out in llm.stream(prompt, params):
                    printer.snapshot(p, out)
            printer.end()
            return 0
        outputs = llm.generate(args.prompts, params)
        if args.json:
            print(json.dumps([output_json(o) for o in outputs], indent=2))
            return 0
        for p, out in enumerate(outputs):
            for comp in out.outputs:
                if labelled:
                    print(label(p, comp.index, len(args.prompts), params.n))
                print(comp.text)
    return 0
