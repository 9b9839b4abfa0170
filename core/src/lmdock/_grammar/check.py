"""The grammar check: a request's grammar is compiled in a worker process before the engine sees it.

Grammars come from clients (JSON schemas, regexes, choices, Lark and GBNF grammars, the tool-call
grammars built from tool schemas), and llguidance's native code can crash on some (a stack overflow
at a few thousand chained rules) or take seconds on others.  So every ``structured_output`` is first
checked by :class:`GrammarCheck` in :mod:`lmdock._grammar.processes`'s workers: compiled with the engine's
tokenizer, its first masks computed, under a deadline.  A crash, a timeout, a compile error or a
grammar that allows no token is a :class:`lmdock.GrammarError` (the server's 400) naming the grammar;
only a grammar that passed is compiled in this process.

The verdicts are cached, keyed by (tokenizer, grammar) digests, for the whole process: a grammar is
checked once per tokenizer, and a grammar that crashed a worker is refused again at once.
``LLM`` checks before it submits (blocking its caller: a Python user's thread); the server awaits
:meth:`GrammarCheck.acheck` first (the check runs on a thread, off the event loop), so the ``LLM``'s
own check then finds the verdict cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from copy import copy
from typing import Any

from lmdock._grammar.processes import GrammarPool, shared_pool
from lmdock._plugin.errors import GrammarError

#: Verdicts kept (least recently used out): a key is two digests, a verdict None or a short message.
CACHE_SIZE = 4096

_verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
_verdicts_lock = threading.Lock()


def tokenizer_spec(tokenizer: Any) -> tuple[Any, ...]:
    """What a worker rebuilds llguidance's tokenizer from: a Hugging Face ``tokenizers`` JSON and its
    EOS, else ``("bytes",)`` (a byte-level stand-in: the check then proves the grammar compiles and
    can start, with the engine's own vocabulary left to the engine)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return ("bytes",)
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = getattr(tokenizer, "eos_token_id", None)
    return ("hf", backend.to_str(), None, [eos] if isinstance(eos, int) else None)


def grammar_key(so: Any) -> str:
    """A digest of a :class:`lmdock.StructuredOutput`'s fields."""
    text = json.dumps([so.json, so.regex, list(so.choice), so.grammar], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def fields_of(so: Any) -> dict[str, Any]:
    return {"json": so.json, "regex": so.regex, "choice": tuple(so.choice), "grammar": so.grammar}


class GrammarCheck:
    """The check for one tokenizer (one per ``LLM``); see the module's docstring."""

    def __init__(self, tokenizer: Any, pool: GrammarPool | None = None) -> None:
        self._tokenizer = tokenizer
        self._pool = pool
        self._spec: tuple[Any, ...] | None = None
        self._key: str | None = None
        self._lock = threading.Lock()

    @property
    def pool(self) -> GrammarPool:
        return self._pool if self._pool is not None else shared_pool()

    def check(self, so: Any) -> None:
        """Return if ``so`` passed (now or before); raise GrammarError naming why it cannot run."""
        if so is None:
            return
        key = (self.tokenizer_key(), grammar_key(so))
        found, verdict = _cached(key)
        if not found:
            verdict = self.pool.check(key[0], self._tokenizer_spec, fields_of(so))
            verdict = _explained(verdict)
            _remember(key, verdict)
        if verdict is not None:
            raise GrammarError(verdict)

    async def acheck(self, so: Any) -> None:
        """:meth:`check` for an event loop: a cached verdict at once, else the check on a thread."""
        if so is None or self.cached(so):
            self.check(so)
            return
        await asyncio.to_thread(self.check, so)

    def cached(self, so: Any) -> bool:
        """Whether ``so``'s verdict is known (then :meth:`check` does not block)."""
        if self._key is None:
            return False
        return _cached((self._key, grammar_key(so)))[0]

    def tokenizer_key(self) -> str:
        with self._lock:
            if self._key is None:
                self._spec = tokenizer_spec(self._tokenizer)
                self._key = hashlib.sha256(repr(self._spec).encode("utf-8", "surrogatepass")).hexdigest()
            return self._key

    def _tokenizer_spec(self) -> tuple[Any, ...]:
        self.tokenizer_key()
        return self._spec or ("bytes",)


def _explained(verdict: str | None) -> str | None:
    """A worker's failure (a crash, the deadline) said as the grammar's refusal; its own refusals as they are."""
    if verdict is None or verdict.startswith("structured_output"):
        return verdict
    return (f"structured_output: the request's grammar (its structured output, or the tool-call grammar built "
            f"from its tools' schemas) was refused: {verdict}. Simplify it (fewer, shallower rules or $defs; "
            "see the limits in docs/structured-output.md)")


def _cached(key: tuple[str, str]) -> tuple[bool, str | None]:
    with _verdicts_lock:
        if key not in _verdicts:
            return False, None
        _verdicts.move_to_end(key)
        return True, _verdicts[key]


def _remember(key: tuple[str, str], verdict: str | None) -> None:
    with _verdicts_lock:
        _verdicts[key] = verdict
        while len(_verdicts) > CACHE_SIZE:
            _verdicts.popitem(last=False)
