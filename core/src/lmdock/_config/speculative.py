"""``[models.NAME.speculative]``: speculative decoding, with vLLM's names (issue 42).

``LLM(..., speculative_config={...})`` and ``lmdock serve --speculative-config JSON`` take the same
keys, and vLLM's older spellings (``ngram_prompt_lookup_max``, ``speculative_model``, ...) as
aliases.  ``method = "none"`` (the default) turns it off.  How the step loop uses it:
``lmdock._engine.speculative``; the knobs and when it turns itself off: ``docs/speculative.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from lmdock._config.schema import check

#: methods the core itself proposes with; a plugin's ``lmdock_speculative_proposer`` may answer others
BUILTIN_METHODS = ("ngram", "draft")
#: vLLM's other names of the built-in methods
_METHOD_NAMES = {"draft_model": "draft"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to propose with, how many tokens, and when to stop speculating."""

    #: vLLM's older spellings (0.6-0.8 engine args), read as the field they name
    ALIASES: ClassVar[dict[str, str]] = {
        "speculative_model": "model",
        "ngram_prompt_lookup_max": "prompt_lookup_max",
        "ngram_prompt_lookup_min": "prompt_lookup_min",
        "speculative_disable_by_batch_size": "disable_by_batch_size",
        "num_lookahead_slots": "num_speculative_tokens",
    }

    #: ``ngram``, ``draft`` (vLLM: ``draft_model``), ``none``; unset: ``draft`` when a model is named
    #: (vLLM's ``{"model": ...}``), else ``none``
    method: str | None = None
    num_speculative_tokens: int = 5
    #: n-gram (prompt lookup): the shortest and longest suffix looked up in the prompt and output so far
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    #: the draft model (``method = "draft"``): a path or hub id, and the backend that loads it (None: the target's)
    model: str | None = None
    backend: str | None = None
    #: with this many sequences or more in a step, none speculates (vLLM's name; None: never off for
    #: size).  lmdock's default is 4: measured on lmdock-hf (docs/benchmarks.md), a batch of 8 already
    #: ran 0.7x slower speculating, its verify rows costing a second forward a step
    disable_by_batch_size: int | None = 4

    def __post_init__(self) -> None:
        method = self.method
        if self.model == "[ngram]":  # vLLM 0.6's spelling of n-gram speculation
            method = "ngram"
            object.__setattr__(self, "model", None)
        if method is None:
            method = "draft" if self.model else "none"
        method = _METHOD_NAMES.get(method, method)
        object.__setattr__(self, "method", method)
        check(bool(method), "method", "must name a method: ngram, draft, or none")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        check(self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
              f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")
        check(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1, "disable_by_batch_size",
              f"must be an integer >= 1 (or unset), got {self.disable_by_batch_size!r}")
        check(method != "draft" or bool(self.model), "model",
              "method 'draft' needs the draft model: a path or hub id sharing the target's tokenizer")

    @property
    def enabled(self) -> bool:
        return self.method != "none"



def parse_json(text: str) -> dict[str, Any]:
    """``--speculative-config JSON`` as a dict (vLLM's flag); a bad one says what is wrong."""
    from lmdock._plugin.errors import ConfigError

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config: not JSON ({exc}); e.g. '{{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 5}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config: expected a JSON object, got {type(value).__name__}")
    return value
