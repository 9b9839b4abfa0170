"""``lmdock batch``: an OpenAI batch file run line by line, resumable (the runner is ``lmdock._llm.batch``)."""

from __future__ import annotations

import argparse
from typing import Any

from lmdock._cli.options import model_args, read_template


def add_parser(sub: Any) -> None:
    """``lmdock batch``'s flags."""
    bt = sub.add_parser(
        "batch", help="run an OpenAI-style batch file (JSONL) and write one result line per input",
        description="Run every line of INPUT (OpenAI batch-file lines: custom_id, url /v1/completions, "
        "/v1/chat/completions or /v1/embeddings, and body) and append one result line per input to OUTPUT, "
        "flushed as each finishes. Every line needs a custom_id of its own: lines whose custom_id is already in "
        "OUTPUT are skipped, so an interrupted run resumes where it stopped; a bad line becomes an error line "
        "of its own. See docs/cli.md.")
    bt.add_argument("input", metavar="INPUT.jsonl")
    bt.add_argument("output", metavar="OUTPUT.jsonl")
    model_args(bt)
    bt.add_argument("--chat-template", metavar="FILE",
                    help="a Jinja chat template file for the /v1/chat/completions lines (as lmdock serve's)")
    bt.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    bt.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmdock._llm.batch import run_batch

    return run_batch(args, read_template(args.chat_template))
