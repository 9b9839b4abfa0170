"""The step-engine side of speculative decoding (issue 42), checked on a raw engine.

Speculative decoding feeds a sequence the engine holds a *verify row*: the last accepted token and
the k proposed ones, at the positions held, with logits at every position (``all_logits``), in the
same step as ordinary decode rows.  It then keeps the accepted prefix and drops the rest with the
engine's ``truncate(seq_id, length)``, so the next chunk starts at ``length``.  These checks hold an
engine to the only thing that matters: every logit it returns afterwards is the logit of a sequence
that never held the dropped tokens (a fresh sequence fed the same tokens, in the same engine), after
a truncate, after a truncate then a fork, and for the verify row itself.

``load_step_engine`` loads a backend's raw step engine (no scheduler, no engine thread) in the
calling thread, so the checks drive ``step`` themselves.  ``check_truncate`` returns None where
``truncate`` is missing or returns False (the engine declares it cannot: the core then runs that model
without speculation), with the reason, and raises AssertionError on a wrong logit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Two texts for the sequences of the scenario: one is speculated on, the other decodes beside it.
TEXTS = ("Once upon a time, there was a little girl named Lily. She loved to play outside",
         "The cat sat on the mat and looked at the big red ball")
#: logprobs of the same sequence computed in two differently shaped steps differ by float rounding
#: only; a dropped token left in the KV state moves them by tenths
ATOL = 2e-3


def load_step_engine(backend: str, model: str, backend_options: dict[str, Any] | None = None) -> Any:
    """``backend``'s step engine for ``model``, loaded through the plugin hooks as ``LLM`` loads it
    (build config and options translated), but not wrapped in the core's runner."""
    from lmdock import ModelConfig
    from lmdock._config.schema import build
    from lmdock._plugin.manager import get_registry

    registry = get_registry()
    spec, hook = registry.backend(backend), registry.hook()
    if spec.kind != "step":
        raise ValueError(f"backend {backend!r} is a {spec.kind} backend: it has no step engine")
    mc = ModelConfig(model=model, backend=backend)
    raw = backend_options or {}
    options = build(spec.options, raw, prefix=f"backends.{backend}") if spec.options else raw
    build_args = hook.lmdock_translate_build_config(backend=backend, model_config=mc) or {}
    engine = hook.lmdock_load_engine(backend=backend, model_config=mc, options=options, quantization=None, build=build_args)
    if engine is None:
        raise ValueError(f"backend {backend!r} declined {model!r}")
    return engine


def truncate_or_reason(engine: Any, seq_id: int, length: int) -> str | None:
    """Call ``engine.truncate``; None when it cut the sequence back, else why not."""
    fn = getattr(engine, "truncate", None)
    if fn is None:
        return f"{type(engine).__name__} has no truncate(seq_id, length): speculative decoding is off for it"
    if not fn(seq_id, length):
        return f"{type(engine).__name__}.truncate returned False for this model: speculative decoding is off for it"
    return None


def _logprobs(logits: Any) -> np.ndarray:
    from lmdock.backend import host_array

    x = np.asarray(host_array(logits), dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class _Expect:
    """Logits to check against a fresh sequence fed ``tokens`` (its rows ``rows``).  The references
    are computed after the scenario: a step of another sequence in between would change how the
    engine batches the scenario's steps (lmdock-mlx's decode group and run-ahead)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, np.ndarray, list[int], slice]] = []

    def add(self, what: str, got: Any, tokens: list[int], rows: slice = slice(-1, None)) -> None:
        from lmdock.backend import host_array

        self.items.append((what, np.array(host_array(got), dtype=np.float32), list(tokens), rows))

    def check(self, engine: Any) -> None:
        from lmdock.backend import SeqChunk

        for what, got, tokens, rows in self.items:
            out = engine.step([SeqChunk(5, tokens, 0, all_logits=True)])
            engine.release(5)
            a, b = _logprobs(got.reshape(-1, got.shape[-1])), _logprobs(np.asarray(out.full[5])[rows])
            assert a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape}"
            err = float(np.abs(a - b).max())
            assert err < ATOL, f"{what}: logprobs differ from a sequence that never held the dropped tokens by {err:.3g}"


def check_truncate(engine: Any, k: int = 4) -> str | None:
    """The whole scenario on ``engine`` (sequence ids 0..2 and 5; all released at the end).  None
    when it holds, the reason when the engine cannot truncate; AssertionError where a logit is wrong."""
    from lmdock.backend import SeqChunk, host_array

    spec_ids, other = (list(engine.tokenizer.encode(t)) for t in TEXTS)
    n = len(spec_ids) - k - 4  # held by the speculated sequence before its verify row
    assert n > 2, f"the check's text encodes to too few tokens ({len(spec_ids)}) with this tokenizer"
    held, verify, after = spec_ids[:n], spec_ids[n : n + k + 1], spec_ids[n + k + 1 :]
    expect = _Expect()
    try:
        # prefill both; the other sequence then decodes greedily beside every later step
        engine.step([SeqChunk(0, held, 0)])
        out = engine.step([SeqChunk(1, other, 0, argmax_next=True)])
        fed: list[int] = [int(np.argmax(host_array(out.last)[0]))]  # the other sequence's tokens

        def decode_other() -> SeqChunk:
            return SeqChunk(1, fed[-1:], len(other) + len(fed) - 1, argmax_next=True)

        def advance(out: Any, row: int) -> None:
            expect.add("a decode row beside them", out.last[row], other + fed)
            fed.append(int(np.argmax(host_array(out.last)[row])))

        # the verify row, mixed with a decode row: logits at every position, as a fresh sequence's
        out = engine.step([SeqChunk(0, verify, n, all_logits=True), decode_other()])
        advance(out, 1)
        expect.add("the verify row's logits", out.full[0], held + verify, slice(n, None))
        # keep two of the k + 1 positions; the next chunk continues from there
        if (reason := truncate_or_reason(engine, 0, n + 2)) is not None:
            return reason
        kept = held + verify[:2]
        # two decode rows (an engine may batch them, and run ahead from their argmax: lmdock-mlx does)
        out = engine.step([SeqChunk(0, after[:1], n + 2, argmax_next=True), decode_other()])
        advance(out, 1)
        expect.add("the first step after truncate", out.last[0], kept + after[:1])
        # cut that token again, right after a step that may have run ahead; then a no-op truncate
        assert truncate_or_reason(engine, 0, n + 2) is None, "truncate succeeded once and then failed"
        assert truncate_or_reason(engine, 0, n + 2) is None, "truncate to the length held must succeed"
        # a second verify row after the truncate
        out = engine.step([decode_other(), SeqChunk(0, after, n + 2, all_logits=True)])
        advance(out, 0)
        expect.add("a verify row after a truncate", out.full[0], kept + after, slice(n + 2, None))
        # truncate, then fork the cut-back sequence; both continue with different tokens
        assert truncate_or_reason(engine, 0, n + 1) is None, "truncate succeeded before and then failed"
        assert engine.fork(0, 2, n + 1), "fork of a truncated sequence failed"
        out = engine.step([SeqChunk(2, after[1:2], n + 1), SeqChunk(0, after[:1], n + 1), decode_other()])
        advance(out, 2)
        expect.add("a fork of a truncated sequence", out.last[0], held + verify[:1] + after[1:2])
        expect.add("a truncated sequence after a fork of it", out.last[1], held + verify[:1] + after[:1])
        assert engine.num_sequences() == 3, f"the engine holds {engine.num_sequences()} sequences, not 3"
        for sid in range(3):
            engine.release(sid)
        expect.check(engine)
        return None
    finally:
        for sid in range(6):
            engine.release(sid)
