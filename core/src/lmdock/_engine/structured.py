"""Structured output for step engines on llguidance: JSON schema, regex, choice and Lark grammars.

:class:`ConstraintFactory` is what the built-in ``lmdock_make_constraints`` hook returns for a step
engine: called with a request's sampling parameters and ``n``, it returns ``n`` :class:`GrammarConstraint`
objects (one llguidance matcher per completion) or None when the request has no ``structured_output``.

- The engine's tokenizer is read by llguidance once, on the first structured request (about a second
  for a 128k vocabulary): a Hugging Face ``tokenizers`` tokenizer, reached as the ``backend_tokenizer``
  attribute (transformers' fast tokenizers and the template's tokenizer have it), else llguidance's
  tokenizer as the tokenizer's own ``llguidance_tokenizer(n_vocab, eos_token_ids)`` makes it
  (lmdock-llamacpp's GGUF vocabulary, through llguidance's llama.cpp reader).
- Each distinct grammar is compiled once per factory (that is, per tokenizer) and kept (least recently
  used out past :data:`CACHE_SIZE`); every completion gets a deep copy of the compiled matcher.
  The compile runs on a thread of its own with :data:`COMPILE_STACK` of stack (llguidance recurses
  over a grammar's rules), with lmdock's :func:`parser_limits`, and computes the first mask there, so
  the engine thread's first step of a new grammar finds its lexer states built.  A grammar from a
  request reaches this module only after :mod:`lmdock._grammar.check` passed it in a worker process.
- EOS is allowed exactly where the grammar accepts; the engine's EOS ids are llguidance's EOS tokens.
- A JSON schema is compiled with what it leaves open bounded (:mod:`lmdock._config.json_schemas`): objects
  that list their properties take no others unless they say so, numbers get bounds, so a model cannot
  spend its whole budget on keys or digits; every output still validates against the schema given.
- A whole batch's masks are filled at once by llguidance's executor (:meth:`ConstraintFactory.fill_masks`)
  and unpacked into the boolean rows :func:`lmdock._engine.constraints.apply_masks` applies.

llguidance is imported here, lazily, on the first request that asks for structured output.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from copy import copy
from typing import Any

import numpy as np

from lmdock._config.json_schemas import bounded_numbers, closed_objects, loosened
from lmdock._engine.llg_vocab import added_tokens_as_text
from lmdock._plugin.errors import RequestError

#: compiled grammars kept per tokenizer
CACHE_SIZE = 128

#: JSON compiler defaults: compact JSON (no free whitespace between tokens), so a model cannot spend its
#: budget on spaces; a schema may override with its own ``"x-guidance"`` options.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}

#: The compile thread's stack: llguidance recurses over a grammar's rules, and the grammar check's
#: worker probes with an eighth of this (``lmdock._grammar.worker.PROBE_STACK``), so what passed there
#: cannot overflow here.
COMPILE_STACK = 64 << 20
_stack_lock = threading.Lock()



def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError as exc:
        raise RequestError("structured_output needs llguidance, which is not installed; pip install llguidance") from exc
    return llguidance


def grammar_for(so: Any) -> tuple[str, str]:
    """``(form, llguidance grammar text)`` for a :class:`lmdock.StructuredOutput`; RequestError if unusable."""
    llg = _llguidance()
    M = llg.LLMatcher
    schema = so.json_schema()
    if schema is not None:
        try:
            return "json", M.grammar_from_json_schema(bounded_numbers(closed_objects(loosened(schema)[0])), defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"structured_output.json: the schema cannot be read: {exc}") from exc
    if so.regex is not None:
        return "regex", M.grammar_from_regex(so.regex)
    if so.choice:
        # a Lark alternation of JSON-quoted literals: any text, matched exactly
        return "choice", M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    grammar = so.grammar
    if "::=" in grammar:  # GBNF (llama.cpp's grammar syntax): llguidance converts it to Lark
        # a module of llguidance (1.7 to 1.9 at least) whose function has the module's name
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as exc:
            raise RequestError(f"structured_output.grammar: this GBNF grammar cannot be converted: {exc}") from exc
    return "grammar", M.grammar_from_lark(grammar)


def parser_limits() -> Any:
    """llguidance's parser limits for every grammar lmdock compiles (its defaults, in one place: the
    worker's check and the engine must compile under the same ones)."""
    return _llguidance().LLParserLimits()


def on_big_stack(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a fresh thread with :data:`COMPILE_STACK` of stack; its result or its error."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller below
            out.append((False, exc))

    with _stack_lock:  # threading.stack_size is process-wide: set it for this thread only
        old = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="lmdock-grammar-compile")
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


class GrammarConstraint:
    """One completion's grammar state (an llguidance matcher): the :class:`Constraint` interface."""

    __slots__ = ("matcher", "_words", "_vocab")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self._vocab = vocab_size
        self._words = (vocab_size + 31) // 32

    def check(self) -> None:
        if self.matcher.is_error():
            raise RequestError(f"structured output: the grammar matcher failed: {self.matcher.get_error()}")

    def allowed(self, out: np.ndarray) -> None:
        self.check()
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        out |= np.unpackbits(bits, bitorder="little")[: out.shape[0]].view(bool)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RequestError(f"structured output: token {token} does not fit the grammar: {self.matcher.get_error()}")

    def is_complete(self) -> bool:
        return bool(self.matcher.is_stopped())


class ConstraintFactory:
    """``make(params, n)`` for one step engine's tokenizer (see the module's docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids if 0 <= int(e) < vocab_size)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def __call__(self, params: Any, n: int) -> list[GrammarConstraint] | None:
        so = params.structured_output
        if so is None:
            return None
        form, grammar = grammar_for(so)
        proto = self.compiled(grammar, form)
        return [GrammarConstraint(proto.deep_copy(), self.vocab_size) for _ in range(n)]

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the engine's tokenizer (built once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self) -> Any:
        llg = _llguidance()
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        own = getattr(self.tokenizer, "llguidance_tokenizer", None)
        if (backend is None or not hasattr(backend, "to_str")) and callable(own):
            try:
                return own(self.vocab_size, list(self.eos_token_ids))
            except Exception as exc:
                raise RequestError(f"structured_output: llguidance cannot read this engine's vocabulary: {type(exc).__name__}: {exc}") from exc
        if backend is None or not hasattr(backend, "to_str"):
            raise RequestError(
                f"structured_output: this engine's tokenizer ({type(self.tokenizer).__name__}) has no Hugging Face "
                "`tokenizers` backend (a `backend_tokenizer` attribute) nor an `llguidance_tokenizer` method, which "
                "llguidance reads the vocabulary from"
            )
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos: Any = list(self.eos_token_ids) or getattr(self.tokenizer, "eos_token_id", None)
        try:
            return llg.LLTokenizer(added_tokens_as_text(backend.to_str()), n_vocab=self.vocab_size, eos_token=eos)
        except Exception as exc:
            raise RequestError(f"structured_output: llguidance cannot read this engine's tokenizer: {type(exc).__name__}: {exc}") from exc

    def compiled(self, grammar: str, form: str = "grammar") -> Any:
        """A fresh matcher for ``grammar`` (compiled once, then cached); RequestError if it does not compile."""
        tok = self.ll_tokenizer()
        with self._lock:
            proto = self._cache.get(grammar)
            if proto is not None:
                self._cache.move_to_end(grammar)
                return proto
        proto = on_big_stack(self._compile, tok, grammar)
        if proto.is_error():
            raise RequestError(f"structured_output.{form}: llguidance cannot compile it: {proto.get_error()}")
        with self._lock:
            self._cache[grammar] = proto
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return proto

    def _compile(self, tok: Any, grammar: str) -> Any:
        """A matcher with its first mask computed (its copies start with the lexer states built)."""
        llg = _llguidance()
        proto = llg.LLMatcher(tok, grammar, log_level=0, limits=parser_limits())
        if not proto.is_error():
            proto.compute_bitmask()
        return proto

    def fill_masks(self, constraints: Sequence[GrammarConstraint], out: np.ndarray) -> None:
        """Fill the boolean rows ``out[i]`` for ``constraints[i]``, all at once (llguidance's executor)."""
        llg = _llguidance()
        for c in constraints:
            c.check()  # a failed matcher raises: the loop then finds it row by row
        if self._executor is None:
            self._executor = llg.LLExecutor()
        words = (out.shape[1] + 31) // 32
        bitmask = np.zeros((len(constraints), words), dtype=np.int32)
        llg.numpy.fill_next_token_bitmask_par(self._executor, [(c.matcher, i) for i, c in enumerate(constraints)], bitmask)
        out |= np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : out.shape[1]].view(bool)
