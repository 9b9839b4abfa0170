"""Checking a request in the caller's thread, before it reaches the loop: a bad one fails at ``submit``.

Token ids in the vocabulary and the context (the prompt's, ``logit_bias``'s and
``allowed_token_ids``'); stop strings only with text; logprob counts within the
vocabulary; the plugins' logits processors; what beam search does not honour, refused by name;
structured output compiled here, so a bad schema fails here too; and a LoRA adapter loaded here
(``prepare_lora``), so an adapter that cannot load fails its request alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmdock._engine.beam import UNSUPPORTED_WITH_BEAMS
from lmdock._engine.biases import check_token_fields
from lmdock._engine.sampler import LogitsProcessor
from lmdock._plugin.contract import EngineRequest
from lmdock._plugin.errors import LmdockError, RequestError

if TYPE_CHECKING:
    from lmdock._engine.step_engine import StepEngineBase

log = logging.getLogger("lmdock.engine")


def check_ids(ids: Sequence[int], vocab: int, max_seq_len: int) -> None:
    bad = next((t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)), None)
    if bad is not None:
        raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
    if len(ids) > max_seq_len:
        raise RequestError(f"{len(ids)} tokens exceed the model's context ({max_seq_len})")


def prepare_lora(engine: StepEngineBase, request: EngineRequest) -> None:
    """Have the step engine load (or check) the request's adapter; refuse the request if it cannot."""
    if request.lora_request is not None:
        load_lora(engine, request.lora_request)


def load_lora(engine: StepEngineBase, lora: Any) -> None:
    """Have the step engine load (or check) ``lora`` (any thread; the backend caches it)."""
    try:
        engine.prepare_lora(lora)
    except LmdockError:
        raise
    except Exception as exc:
        # the exception's text may quote the adapter's files (any file a path can name): the log has it
        log.warning("lora_request %r: loading %r failed", lora.name, lora.path, exc_info=exc)
        raise RequestError(f"lora_request {lora.name!r}: the adapter at {lora.path!r} could not be loaded ({type(exc).__name__}; the "
                           "server's log has the details)") from exc


def check_request(
    request: EngineRequest, vocab: int, max_seq_len: int, processors_for: Callable[[Any], Sequence[LogitsProcessor]]
) -> list[LogitsProcessor]:
    """Refuse what the loop cannot honour; return the request's logits processors."""
    ids, p = request.prompt_token_ids, request.params
    if not ids:
        raise RequestError("the prompt is empty: give at least one token or a non-empty string")
    if len(ids) >= max_seq_len:
        raise RequestError(
            f"the prompt has {len(ids)} tokens but the model's context is {max_seq_len}; "
            "shorten the prompt to leave room for the output"
        )
    check_ids(ids, vocab, max_seq_len)
    check_token_fields(p, vocab)
    if p.stop and not p.detokenize:
        raise RequestError("stop strings need detokenize=True; use stop_token_ids instead")
    bad_stop = next((t for t in p.stop_token_ids if not 0 <= t < vocab), None)
    if bad_stop is not None:
        raise RequestError(f"stop_token_ids: {bad_stop} is outside the vocabulary [0, {vocab})")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and k > vocab:
            raise RequestError(f"{name}={k} is larger than the vocabulary ({vocab})")
    processors = _processors(p, processors_for)
    if p.beam_width > 1:
        _check_beams(p, processors)
    return processors


def _processors(params: Any, processors_for: Callable[[Any], Sequence[LogitsProcessor]]) -> list[LogitsProcessor]:
    try:
        return list(processors_for(params))
    except LmdockError:
        raise
    except Exception as exc:
        raise RequestError(f"a plugin's lmdock_logits_processors hook failed: {type(exc).__name__}: {exc}") from exc


def _check_beams(p: Any, processors: Sequence[LogitsProcessor]) -> None:
    bad = [name for name, neutral in UNSUPPORTED_WITH_BEAMS.items() if getattr(p, name) not in (neutral, None)]
    if processors:
        bad.append("logits processors from " + ", ".join(sorted({getattr(x, "plugin", "a plugin") for x in processors})))
    if bad:
        raise RequestError(
            f"beam search (beam_width={p.beam_width}) does not honour {', '.join(bad)}; "
            "remove them, or sample instead of beam search"
        )


def compile_constraints(request: EngineRequest, constraints_for: Callable[[Any, int], Sequence[Any] | None] | None) -> Sequence[Any] | None:
    """Compile the request's structured output: one constraint per completion, or None."""
    if request.params.structured_output is None:
        return None
    if constraints_for is None:
        raise RequestError("structured_output: this engine has no grammar engine; pip install llguidance")
    return constraints_for(request.params, request.params.n)
