"""Beam search over vLLM's request API, the way ``vllm.LLM.beam_search`` builds it on the engine.

vLLM keeps beam search out of ``LLMEngine``'s requests, so each round:

1. every live beam of a beam request becomes one vLLM request for one greedy token with
   ``2 * beam_width`` logprobs (plus the ending tokens), all beams of all beam requests in the same
   vLLM steps, vLLM's prefix caching keeping the shared prompt and history computed once;
2. when every beam's row is in, the core's bookkeeping (``lmdock.backend.BeamSearch.step_top``,
   transformers' semantics) picks the next beams;
3. the request is answered when the search is done, else the next round starts.

Everything here runs on the engine thread; a failure is the beam request's own and goes to its sink.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lmdock import RequestError
from lmdock.backend import CompletionOutput, EngineRequest, OutputSink, RequestOutput, safe_fail, safe_put

from lmdock_vllm._convert import one_token_params


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    logprob: float  # running sum


@dataclass
class BeamRequest:
    request: EngineRequest
    sink: OutputSink
    search: Any  # lmdock.backend.BeamSearch: transformers' bookkeeping, shared with the core
    params: Any  # vLLM SamplingParams of one beam's step
    ends: frozenset[int]
    beams: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    rows: list[dict[int, float] | None] = field(default_factory=list)

    @classmethod
    def make(cls, request: EngineRequest, sink: OutputSink, eos_token_ids: frozenset[int], max_logprobs: int) -> BeamRequest:
        """Check what beam search can honour and size its steps; raises RequestError in submit()."""
        p = request.params
        unhonoured = [name for name, value, default in beam_ignored(p) if value != default]
        if unhonoured:
            raise RequestError(
                f"beam search on vLLM ranks the model's own logprobs: {', '.join(unhonoured)} cannot apply to it; "
                "remove them, or sample without beam_width"
            )
        ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos_token_ids)
        width = p.beam_width
        params = one_token_params(2 * width + len(ends))
        if max_logprobs >= 0 and 2 * width + len(ends) > max_logprobs:
            raise RequestError(
                f"beam_width={width} needs {2 * width + len(ends)} logprobs per step but backends.vllm.max_logprobs is "
                f"{max_logprobs}; raise that option or use a smaller beam_width"
            )
        from lmdock.backend import BeamSearch

        return cls(request, sink, BeamSearch(width, p.length_penalty, p.early_stopping), params, ends)

    def outputs(self, tokenizer: Any) -> list[CompletionOutput]:
        p = self.request.params
        outs = []
        for index, hyp in enumerate(self.search.hyps[: p.n]):
            text = tokenizer.decode(hyp.token_ids, skip_special_tokens=p.skip_special_tokens) if p.detokenize else ""
            ended = bool(hyp.token_ids) and hyp.token_ids[-1] in self.ends
            outs.append(CompletionOutput(index, text, hyp.token_ids, hyp.logprob, None, "stop" if ended else "length"))
        return outs

    def answer(self, outputs: list[CompletionOutput]) -> None:
        req = self.request
        safe_put(self.sink, RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outputs, True))


def beam_ignored(p: Any) -> list[tuple[str, Any, Any]]:
    """Parameters beam search cannot honour on vLLM, with the value that means "off"."""
    return [
        ("stop", list(p.stop), []),
        ("logprobs", p.logprobs, None),
        ("prompt_logprobs", p.prompt_logprobs, None),
        ("presence_penalty", p.presence_penalty, 0.0),
        ("frequency_penalty", p.frequency_penalty, 0.0),
        ("repetition_penalty", p.repetition_penalty, 1.0),
        ("structured_output", p.structured_output, None),
        ("logit_bias", p.logit_bias, {}),
        ("allowed_token_ids", p.allowed_token_ids, None),
        ("bad_words", p.bad_words, ()),
    ]


class BeamSearches:
    """The beam requests in flight (by lmdock request id) and their beams' vLLM requests (by vLLM id)."""

    def __init__(self, engine: Any, tokenizer: Any, max_seq_len: int, ids: Iterator[int]) -> None:
        self._engine = engine  # vLLM's LLMEngine
        self._tokenizer = tokenizer
        self._max_seq_len = max_seq_len
        self._ids = ids  # shared with the next-token queries' request ids
        self.requests: dict[str, BeamRequest] = {}
        self.rows: dict[str, tuple[BeamRequest, int]] = {}  # vLLM request id -> (its beam search, beam index)

    def __len__(self) -> int:
        return len(self.requests)

    def owns(self, rid: str) -> bool:
        return rid in self.rows

    def start(self, beam: BeamRequest) -> None:
        self.requests[beam.request.request_id] = beam
        self._round(beam)

    def _round(self, beam: BeamRequest) -> None:
        """Ask vLLM for the next-token logprobs of every live beam."""
        prompt = list(beam.request.prompt_token_ids)
        beam.rows = [None] * len(beam.beams)
        try:
            for i, b in enumerate(beam.beams):
                rid = f"lmdock-beam-{next(self._ids)}"
                self._engine.add_request(rid, {"prompt_token_ids": prompt + b.token_ids}, beam.params)
                self.rows[rid] = (beam, i)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            self._abort_rows(beam)
            self.requests.pop(beam.request.request_id, None)
            safe_fail(beam.sink, RequestError(f"vLLM refused a beam of request {beam.request.request_id}: {exc}"))

    def _abort_rows(self, beam: BeamRequest) -> None:
        rows = [rid for rid, (b, _) in self.rows.items() if b is beam]
        for rid in rows:
            del self.rows[rid]
        if rows:
            self._engine.abort_request(rows)

    def row_done(self, rid: str, out: Any) -> None:
        """vLLM's output for one beam's step; the last of a round picks the next beams."""
        if not out.finished:
            return
        beam, i = self.rows.pop(rid)
        beam.rows[i] = {int(t): float(lp.logprob) for t, lp in out.outputs[0].logprobs[0].items()}
        if any(r is None for r in beam.rows):
            return
        self._choose(beam)
        if beam.search.done:
            del self.requests[beam.request.request_id]
            beam.answer(beam.outputs(self._tokenizer))
        else:
            self._round(beam)

    def _choose(self, beam: BeamRequest) -> None:
        p = beam.request.params
        n_out = len(beam.beams[0].token_ids)
        limit = p.max_new_tokens
        at_limit = (limit is not None and n_out + 1 >= limit) or len(beam.request.prompt_token_ids) + n_out + 1 >= self._max_seq_len
        outputs = [b.token_ids for b in beam.beams]
        choices = beam.search.step_top(outputs, [b.logprob for b in beam.beams], beam.rows, beam.ends, at_limit,  # type: ignore[arg-type]
                                       mask_ends=n_out < p.min_new_tokens)
        beam.beams = [Beam([*outputs[c.beam], c.token], c.logprob) for c in choices]

    def abort(self, request_id: str) -> bool:
        """End beam request ``request_id`` now with the hypotheses so far; False if it is not one."""
        beam = self.requests.pop(request_id, None)
        if beam is None:
            return False
        self._abort_rows(beam)
        beam.answer(beam.outputs(self._tokenizer) or [CompletionOutput(0, "", [], finish_reason="abort")])
        return True

    def fail_all(self, error: BaseException) -> None:
        for beam in list(self.requests.values()):
            safe_fail(beam.sink, error)
        self.requests.clear()
        self.rows.clear()
