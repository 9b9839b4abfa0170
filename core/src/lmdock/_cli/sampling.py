"""The sampling flags of ``lmdock generate`` and ``lmdock chat``, derived from the one table of request
fields (``lmdock._config.foreign.OPENAI_FIELDS``) that the server and ``lmdock batch`` read: each field it
maps to is a flag under lmdock's name (``--max-new-tokens``) and under OpenAI's and vLLM's names for
it (``--max-tokens``, ``--max-completion-tokens``), so a field added to the table is reachable here too.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from lmdock._config.foreign import OPENAI_FIELDS
from lmdock._config.sampling import SamplingParams

#: How a flag reads its value, for the fields that are not one number or a switch.
_KINDS: dict[str, dict[str, Any]] = {
    "stop": {"action": "append", "metavar": "TEXT", "help": "a stop string (repeatable)"},
    "stop_token_ids": {"action": "append", "type": int, "metavar": "ID", "help": "a token id that stops generation (repeatable)"},
    "bad_words": {"action": "append", "metavar": "WORD", "help": "a word never generated, as vLLM bans it (repeatable)"},
    "allowed_token_ids": {"action": "extend", "metavar": "ID,ID,...",
                          "help": "generate only these token ids (comma-separated; repeatable)"},
    "logit_bias": {"action": "append", "metavar": "ID=BIAS",
                   "help": "add BIAS, in [-100, 100], to token ID's logit: -100 bans it (repeatable)"},
}
_HELP = {
    "max_new_tokens": "tokens to generate at most (--max-tokens: OpenAI's and vLLM's name for it)",
    "n": "completions per prompt",
}
#: Short flags kept beside the derived ones.
_SHORT = {"n": "-n"}


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are integers separated by commas, got {text!r}") from None


def _bias(text: str) -> tuple[int, float]:
    token, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a logit bias is TOKEN_ID=BIAS (e.g. 432=-100), got {text!r}") from None


_TYPES = {"allowed_token_ids": _token_ids, "logit_bias": _bias}


def fields() -> list[str]:
    """The SamplingParams fields that have flags: those the table maps to, in its order."""
    return list(dict.fromkeys(OPENAI_FIELDS.values()))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """One flag per field of the table, under every name the table gives it."""
    kinds = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for field in fields():
        names = [field, *(name for name, target in OPENAI_FIELDS.items() if target == field and name != field)]
        flags = [*([_SHORT[field]] if field in _SHORT else []), *dict.fromkeys("--" + n.replace("_", "-") for n in names)]
        spec = dict(_KINDS.get(field, {}))
        if field in _TYPES:
            spec["type"] = _TYPES[field]
        if not spec:
            hint = str(kinds[field].type)
            if hint == "bool":
                spec = {"action": argparse.BooleanOptionalAction}
            else:
                spec = {"type": float, "metavar": "X"} if "float" in hint else {"type": int, "metavar": "N"}
        if field in _HELP:
            spec["help"] = _HELP[field]
        p.add_argument(*flags, dest=field, default=None, **spec)


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the flags set."""
    out = {f: getattr(args, f) for f in fields() if getattr(args, f, None) is not None}
    if "logit_bias" in out:
        out["logit_bias"] = dict(out["logit_bias"])
    return out
