"""What the loop tracks: a request, its completions (sequences), and next-token queries.

A sequence's ``held`` flag is the release rule in one place: it is set just before the first engine
step that includes the sequence (the engine may take KV state for it from that moment, even if the
step fails) or when a fork gave it KV state, and cleared by the one release that follows.  Every path
that ends a sequence (finish, stop, abort, failure, preemption, beam pruning, shutdown) goes through
``lmdock._engine.kv``, which releases a held sequence exactly once.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmdock._engine.beam import BeamSearch
from lmdock._engine.detok import IncrementalDetokenizer
from lmdock._engine.sampler import LogitsProcessor, SampleRow
from lmdock._engine.stops import StopStrings

if TYPE_CHECKING:
    from lmdock._llm.outputs import PositionLogprobs
    from lmdock._plugin.contract import EngineRequest, OutputSink, StepEngine


class Seq:
    """One completion of a request: its tokens, KV progress, sampling state and text."""

    def __init__(self, seq_id: int, req: Req, index: int, engine: StepEngine) -> None:
        params = req.request.params
        self.seq_id = seq_id
        self.req: Req | None = req
        self.index = index
        self.token_ids = list(req.request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.num_computed = 0
        self.held = False
        #: Sequences of one group are preempted and readmitted together (a beam search's beams).
        self.group: str | None = req.request.request_id if req.beam is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        seed = np.random.default_rng() if params.seed is None else np.random.default_rng([params.seed, index])
        self.row = SampleRow(params, self.token_ids, self.prompt_len, seed, engine.eos_token_ids, req.processors, req.bad_words)
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None or req.beam is not None else None
        self.detok = (
            IncrementalDetokenizer(engine.tokenizer, self.token_ids, params.skip_special_tokens)
            if params.detokenize
            else None
        )
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.beam_lp: np.ndarray | None = None  # beam search: this step's log-softmax, awaiting the others
        #: structured output: this completion's own constraint (``lmdock._engine.constraints``), or None
        self.constraint: Any = req.constraints[index] if req.constraints is not None else None
        #: the next token is the argmax of the logits once ``min_new_tokens`` is reached
        #: (``SeqChunk.argmax_next``)
        self.argmax_from: int | None = (
            params.min_new_tokens if self.row.plain and self.constraint is None and req.beam is None else None
        )

    def fork(self, seq_id: int) -> Seq:
        """A copy for another beam; KV state is the caller's business (``held`` starts False)."""
        child = copy.copy(self)
        child.seq_id = seq_id
        child.token_ids = list(self.token_ids)
        child.held = False
        child.beam_lp = None
        child.stops = self.stops.copy()  # its own place in the stop strings' automaton
        return child

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def visible_text(self) -> str:
        if self.finish_reason is not None or not self.stops.stops:
            return self.text
        return self.text[: max(0, len(self.text) - self.stops.holdback)]


class Req:
    """One request: its sink, its sequences, its beam search and its prompt logprobs."""

    def __init__(
        self, request: EngineRequest, sink: OutputSink, processors: Sequence[LogitsProcessor], constraints: Sequence[Any] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
    ) -> None:
        self.request = request
        self.sink = sink
        self.processors = processors
        self.constraints = constraints
        self.bad_words = bad_words  # the token sequences of params.bad_words
        self.seqs: list[Seq] = []
        #: n > 1: completions waiting for the first one's prompt KV state, to fork it
        self.followers: list[Seq] = []
        self.cached = False  # its prompt's KV state went to the prefix cache
        self.cached_tokens = 0  # prompt tokens it took from the prefix cache
        self.done = False  # reported finished or failed: nothing more goes to the sink
        p = request.params
        self.beam = BeamSearch(p.beam_width, p.length_penalty, p.early_stopping) if p.beam_width > 1 else None
        want = request.params.prompt_logprobs
        # position 0 has no logprob; position p's entry is at index p once recorded
        self.prompt_logprobs: list[PositionLogprobs | None] | None = [None] if want is not None else None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.finish_reason is not None for s in self.seqs)


class QuerySeq:
    """A next-token-logprobs query: prefilled, never sampled; its KV state goes to the prefix cache."""

    req = None
    index = 0
    group = None
    finish_reason = None
    argmax_from = None

    def __init__(self, seq_id: int, token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.num_computed = 0
        self.held = False
        self.done = False
        self.futures: list[concurrent.futures.Future[np.ndarray]] = []


def live(seq: Seq | QuerySeq) -> bool:
    """Still to be computed: not finished, and (for a request's sequence) its request not ended."""
    if isinstance(seq, QuerySeq):
        return not seq.done
    return seq.finish_reason is None and seq.req is not None and not seq.req.done
