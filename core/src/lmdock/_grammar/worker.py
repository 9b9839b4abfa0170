"""The grammar check's worker process: compile a client's grammar where a crash costs one process.

Run as ``python -m lmdock._grammar.worker`` by :mod:`lmdock._grammar.processes` (spawned, never forked, so
no lock of a threaded parent is inherited and a user's ``__main__`` is not re-run).  It reads jobs from
stdin and writes one reply per job to the pipe that was stdout (fd 1 then points at stderr, so nothing
a native library prints can corrupt a reply).  Messages are length-prefixed pickles; both ends are
lmdock.

A job is ``(tokenizer key, tokenizer spec or None, structured output fields)``; the reply is
``("ok", None)``, ``("refused", message)`` or ``("need_tokenizer", None)`` when this worker has not
seen that tokenizer yet.  The probe (:func:`probe`) does what the engine will do, in the same order,
and the first steps of generation besides:

1. build llguidance's grammar text (``lmdock._engine.structured.grammar_for``);
2. ``LLMatcher.validate_grammar`` with lmdock's parser limits;
3. compile a matcher, on a thread whose stack is smaller than the engine's compile thread
   (:data:`lmdock._engine.structured.COMPILE_STACK`), so recursion that fits here fits there;
4. compute the first masks as the engine does (llguidance's executor), following the first allowed
   token for :data:`PROBE_STEPS` steps: a grammar that allows no token, or fails a step, or whose
   mask takes longer than :data:`STEP_BUDGET_S`, is refused here instead of stalling the engine.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

#: The probe thread's stack: an eighth of the engine's compile thread (recursion depth is the risk).
PROBE_STACK = 8 << 20
#: Steps of generation the probe walks (mask, then the first allowed token).
PROBE_STEPS = 3
#: A mask that takes longer than this (seconds, on the worker's idle core) stalls every stream of
#: the engine for as long on each such step: the grammar is refused.
STEP_BUDGET_S = 0.5
#: The worker's data limit (bytes): a grammar whose compile wants more is refused (the worker dies).
DATA_LIMIT = 4 << 30

_HEADER = struct.Struct("<Q")


def send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def recv(stream: BinaryIO) -> Any:
    """The next message, or EOFError when the other end is gone."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def tokenizer_from(spec: tuple[Any, ...]) -> Any:
    """llguidance's tokenizer from what :func:`lmdock._grammar.check.tokenizer_spec` sent."""
    import llguidance

    kind = spec[0]
    if kind == "hf":
        _, text, n_vocab, eos = spec
        return llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


class _ByteTokenizer:
    """A stand-in vocabulary of the 256 bytes and an EOS, for engines whose tokenizer cannot be sent."""

    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff</s>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def probe(tokenizer: Any, fields: dict[str, Any]) -> str | None:
    """None if the grammar is fit to compile in the engine, else why not."""
    import llguidance

    from lmdock._config.sampling import StructuredOutput
    from lmdock._engine.structured import grammar_for, parser_limits
    from lmdock._plugin.errors import RequestError

    try:
        form, grammar = grammar_for(StructuredOutput(**fields))
    except RequestError as exc:
        return str(exc)
    limits = parser_limits()
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
    if error:
        return f"structured_output.{form}: llguidance cannot compile it: {error}"
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return f"structured_output.{form}: llguidance cannot compile it: {matcher.get_error()}"
    return first_steps(matcher, tokenizer.vocab_size, form)


def first_steps(matcher: Any, vocab_size: int, form: str) -> str | None:
    """Walk :data:`PROBE_STEPS` steps as the engine would (masks by llguidance's executor, then the
    first allowed token); why the grammar cannot run, or None."""
    import llguidance
    import llguidance.numpy
    import numpy as np

    executor = llguidance.LLExecutor()
    for step in range(PROBE_STEPS):
        bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(matcher, 0)], bitmask)
        took = time.perf_counter() - start
        if matcher.is_error():
            why = matcher.get_error().splitlines()[0]
            if step == 0:
                return f"structured_output.{form}: the grammar cannot produce a first token (llguidance: {why})"
            return f"structured_output.{form}: the grammar fails at token {step + 1} (llguidance: {why})"
        if took > STEP_BUDGET_S:
            return (f"structured_output.{form}: computing the allowed tokens at token {step + 1} took {took:.1f} s "
                    f"(the limit is {STEP_BUDGET_S} s a step, which would stall every other request); simplify the grammar")
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size])
        if allowed.size == 0:
            return f"structured_output.{form}: the grammar allows no token at all; it can never be satisfied" if step == 0 else None
        if matcher.is_stopped() or not matcher.consume_token(int(allowed[0])):
            return None
    return None


def _serve(jobs: BinaryIO, replies: BinaryIO) -> None:
    tokenizers: dict[str, Any] = {}
    while True:
        try:
            key, spec, fields = recv(jobs)
        except EOFError:
            return
        if spec is not None:
            try:
                tokenizers[key] = tokenizer_from(spec)
            except Exception:  # llguidance cannot read it: check against the byte-level stand-in
                tokenizers[key] = tokenizer_from(("bytes",))
        if key not in tokenizers:
            send(replies, ("need_tokenizer", None))
            continue
        send(replies, _run_probe(tokenizers[key], fields))


def _run_probe(tokenizer: Any, fields: dict[str, Any]) -> tuple[str, str | None]:
    """The probe on a thread with :data:`PROBE_STACK` of stack (a stack overflow kills the worker)."""
    result: list[tuple[str, str | None]] = []

    def run() -> None:
        try:
            error = probe(tokenizer, fields)
        except Exception as exc:  # a Python-level failure of the probe is the grammar's refusal too
            error = f"structured_output: the grammar check failed: {type(exc).__name__}: {exc}"
        result.append(("ok", None) if error is None else ("refused", error))

    threading.stack_size(PROBE_STACK)
    thread = threading.Thread(target=run, name="lmdock-grammar-probe")
    thread.start()
    thread.join()
    return result[0]


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))
    except (ImportError, ValueError, OSError):  # not on this platform, or a lower hard limit: keep it
        pass


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout lands in stderr
    sys.stdout = sys.stderr
    _limit_memory()
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
