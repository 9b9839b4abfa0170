"""One engine step: the chunk each planned sequence feeds, and a check of what the engine returns."""

from __future__ import annotations

from typing import Any

from lmdock._engine.sequence import QuerySeq, Seq
from lmdock._plugin.contract import SeqChunk, StepEngine
from lmdock._plugin.errors import BackendError


def chunk_for(seq: Seq | QuerySeq, n: int) -> SeqChunk:
    """The next ``n`` tokens of ``seq``; with all logits where its prompt logprobs still need them,
    ``argmax_next`` where its next token will be the argmax (``Seq.argmax_from``), and the request's
    LoRA adapter."""
    start = seq.num_computed
    req = seq.req
    want_all = (
        req is not None
        and req.prompt_logprobs is not None
        and seq.index == 0
        and len(req.prompt_logprobs) < seq.prompt_len
        and start < seq.prompt_len
    )
    ahead = seq.argmax_from is not None and start + n == len(seq.token_ids) and seq.num_output >= seq.argmax_from
    lora = req.request.lora_request if req is not None else None
    images = req.request.multi_modal if req is not None and start < seq.prompt_len else None  # prefill chunks only
    return SeqChunk(seq.seq_id, seq.token_ids[start : start + n], start, want_all, ahead, lora, images)


def run_step(engine: StepEngine, chunks: list[SeqChunk]) -> Any:
    """``engine.step(chunks)``, checked: a malformed result raises :class:`BackendError`."""
    out = engine.step(chunks)
    check_output(out, chunks, engine.vocab_size)
    return out


def check_output(out: Any, chunks: list[SeqChunk], vocab: int) -> None:
    last = getattr(out, "last", None)
    shape = getattr(last, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != len(chunks) or shape[1] < vocab:
        raise BackendError(f"the backend returned logits of shape {shape} for {len(chunks)} chunks and a vocabulary of {vocab}")
    for c in chunks:
        if c.all_logits and c.seq_id not in out.full:
            raise BackendError(f"the backend returned no full logits for sequence {c.seq_id}, which asked for them")
