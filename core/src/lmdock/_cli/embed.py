"""``lmdock embed``: embeddings of texts as JSON (an embedding model)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lmdock._cli.options import model_args, open_llm


def add_parser(sub: Any) -> None:
    """``lmdock embed``'s flags."""
    e = sub.add_parser("embed", help="print embeddings of texts as JSON (an embedding model)")
    model_args(e)
    e.add_argument("texts", nargs="+", metavar="TEXT")
    e.add_argument("--dimensions", type=int, help="keep the first N values (Matryoshka), then normalize")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None, help="unit-length vectors (default: the model's)")
    e.add_argument("--truncate", type=int, metavar="N", help="cut longer texts to N tokens (-1: the model's maximum)")
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmdock._config.pooling import PoolingParams
    from lmdock._config.schema import build

    fields = {"normalize": args.normalize, "dimensions": args.dimensions, "truncate_prompt_tokens": args.truncate}
    params = build(PoolingParams, {k: v for k, v in fields.items() if v is not None}, source="<command line>")
    with open_llm(args) as llm:
        outputs = llm.embed(args.texts, params)
    data = [{"index": i, "text": t, "prompt_token_ids": o.prompt_token_ids, "embedding": o.outputs.embedding}
            for i, (t, o) in enumerate(zip(args.texts, outputs))]
    print(json.dumps(data, ensure_ascii=False))
    return 0
