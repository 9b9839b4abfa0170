"""Turning sampled tokens into what callers see (vLLM v1's OutputProcessor is the model): stop
conditions, incremental detokenization with stop strings, logprob entries, prompt logprobs, and the
cumulative ``RequestOutput`` snapshots a sink receives."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lmdock._engine.failures import Failure, as_request_error
from lmdock._engine.sampler import Sample, log_softmax
from lmdock._engine.sequence import Req, Seq
from lmdock._llm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from lmdock._plugin.contract import SeqChunk

#: Tokens before a token decoded with it for its ``decoded_token`` (a SentencePiece space, a character
#: split over byte tokens)
IN_CONTEXT_WINDOW = 4

if TYPE_CHECKING:
    from lmdock._engine.kv import KV


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_seq_len = max_seq_len

    # -- one step's tokens ------------------------------------------------------------------------------

    def process(
        self, seqs: list[Seq], samples: Sequence[Sample | None], kv: KV, texts: list[tuple[Seq, int, bool]] | None
    ) -> tuple[Collection[Req], list[Failure]]:
        """Append each sample, tell its constraint, check stops; release finished sequences at once.
        With ``texts`` (the overlap), the text of requests without stop strings is not pushed here:
        ``(seq, token, stopped by a token)`` goes to ``texts`` instead.  Returns the requests to
        report and the failures (a failing sequence's siblings are skipped)."""
        touched: dict[int, Req] = {}
        failures: list[Failure] = []
        failed: set[int] | None = None  # requests failed this step: their other completions are skipped
        append, append_token = self.append, self.append_token
        for seq, sample in zip(seqs, samples):
            req = seq.req
            if sample is None or req.done or seq.finish_reason is not None or (failed is not None and id(req) in failed):  # type: ignore[union-attr]
                continue
            try:
                if seq.constraint is not None:
                    seq.constraint.accept(sample.token)
                if texts is not None and not seq.stops.stops:
                    by_token = append_token(seq, sample)
                    if seq.detok is not None:
                        texts.append((seq, sample.token, by_token))
                else:
                    append(seq, sample)
                if seq.finish_reason is None and seq.constraint is not None and seq.constraint.is_complete():
                    seq.finish_reason = "stop"  # the grammar can take no more tokens
            except Exception as exc:
                failed = (failed or set()) | {id(req)}
                failures.append((seq, as_request_error(exc, "structured output" if seq.constraint is not None else "detokenizing and checking stops")))
                continue
            if seq.finish_reason is not None:
                kv.release(seq)
                touched[id(req)] = req  # type: ignore[assignment]
            elif req.request.stream:  # type: ignore[union-attr]
                touched[id(req)] = req  # type: ignore[assignment]
        return touched.values(), failures

    # -- one new token ------------------------------------------------------------------------------

    def append(self, seq: Seq, sample: Sample) -> None:
        """Append a sampled token; set ``finish_reason`` when a stop condition holds.  The caller
        releases finished sequences."""
        by_token = self.append_token(seq, sample)
        self.push_text(seq, sample.token, by_token)

    def append_token(self, seq: Seq, sample: Sample) -> bool:
        """The half of :meth:`append` that the next step depends on: the token, its logprobs, and the
        stops that need no text (EOS, stop token ids, length).  True if a stop token ended it."""
        tok = sample.token
        params = seq.row.params
        if seq.logprobs is not None and sample.logprob is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sample.logprob
            seq.logprobs.append(self._sample_logprobs(sample, seq.token_ids, params.skip_special_tokens))
        seq.token_ids.append(tok)
        if seq.num_output >= params.min_new_tokens:
            if not params.ignore_eos and tok in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
            if tok in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
                return True
        limit = params.max_new_tokens
        if (limit is not None and seq.num_output >= limit) or len(seq.token_ids) >= self.max_seq_len:
            seq.finish_reason = "length"
        return False

    def push_text(self, seq: Seq, tok: int, by_token: bool) -> None:
        """The other half: incremental detokenization and stop strings.  Only a request with stop
        strings can finish here; for the others the runner may run this while the engine computes
        the next step (``lmdock._engine.overlap``)."""
        if seq.detok is None or (by_token and not seq.row.params.include_stop_str_in_output):
            return
        delta = seq.detok.push(tok)
        seq.text = seq.detok.text
        if not by_token and seq.stops.stops and seq.num_output >= seq.row.params.min_new_tokens:
            hit = seq.stops.find(seq.text, len(delta))
            if hit is not None:
                seq.text, seq.stop_reason = hit
                seq.finish_reason = "stop"  # a stop string wins over the length limit of the same token

    # -- logprobs -----------------------------------------------------------------------------------

    def record_prompt_logprobs(self, seq: Seq, chunk: SeqChunk, full: np.ndarray) -> None:
        """Prompt logprobs of the positions this chunk computed that are not recorded yet (a sequence
        recomputed after a preemption computes them again; they are kept once)."""
        req = seq.req
        assert req is not None and req.prompt_logprobs is not None  # noqa: S101 - guarded by the caller
        plp = req.prompt_logprobs
        k = req.request.params.prompt_logprobs or 0
        rows = [i for i in range(len(chunk.token_ids)) if len(plp) <= chunk.start + i + 1 < seq.prompt_len]
        if not rows:
            return
        lps = log_softmax(full[rows])
        for r, lp in zip(rows, lps):
            if chunk.start + r + 1 != len(plp):
                continue  # never leave a hole
            at = chunk.start + r + 1
            plp.append(self._position_logprobs(seq.token_ids[at], lp, k, seq.token_ids[:at], seq.row.params.skip_special_tokens))

    def _in_context(self, before: Sequence[int], skip_special: bool) -> Callable[[int], str]:
        """A token's ``decoded_token``: the text it adds after the tokens before it (a short window of
        them decoded with and without it), so a sequence's token strings join to its text; decoded
        alone, a SentencePiece token loses its leading space (issue 29)."""
        decode, window = self.tokenizer.decode, list(before[-IN_CONTEXT_WINDOW:])
        head = decode(window, skip_special_tokens=skip_special) if window else ""

        def text(token: int) -> str:
            whole = decode([*window, token], skip_special_tokens=skip_special)
            return whole[len(head):] if whole.startswith(head) else decode([token], skip_special_tokens=skip_special)

        return text

    def _position_logprobs(self, token: int, lp: np.ndarray, k: int, before: Sequence[int], skip_special: bool) -> PositionLogprobs:
        text = self._in_context(before, skip_special)
        entry = {token: Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1, text(token))}
        if k:
            top = np.argsort(-lp, kind="stable")[:k]
            for rank, t in enumerate(top, start=1):
                entry.setdefault(int(t), Logprob(float(lp[t]), rank, text(int(t))))
        return entry

    def _sample_logprobs(self, sample: Sample, before: Sequence[int], skip_special: bool) -> PositionLogprobs:
        text = self._in_context(before, skip_special)
        entry = {sample.token: Logprob(sample.logprob or 0.0, sample.rank, text(sample.token))}
        for rank, (t, lp) in enumerate(sample.top, start=1):
            entry.setdefault(t, Logprob(lp, rank, text(t)))
        return entry

    # -- snapshots ----------------------------------------------------------------------------------

    def snapshot(self, req: Req) -> RequestOutput:
        if req.beam is not None:
            outs = self._beam_outputs(req) if req.beam.done else []
        else:
            outs = [
                CompletionOutput(
                    index=s.index,
                    text=s.visible_text(),
                    token_ids=s.token_ids[s.prompt_len :],
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in req.seqs
            ]
        return RequestOutput(
            request_id=req.request.request_id,
            prompt=req.request.prompt,
            prompt_token_ids=list(req.request.prompt_token_ids),
            outputs=outs,
            finished=req.finished,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            num_cached_tokens=req.cached_tokens,
        )

    def _beam_outputs(self, req: Req) -> list[CompletionOutput]:
        assert req.beam is not None  # noqa: S101
        p = req.request.params
        eos = set(self.eos_token_ids) | set(p.stop_token_ids)
        outs = []
        for index, hyp in enumerate(req.beam.hyps[: p.n]):
            text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=p.skip_special_tokens) if p.detokenize else ""
            ended = bool(hyp.token_ids) and hyp.token_ids[-1] in eos
            outs.append(CompletionOutput(index, text, hyp.token_ids, hyp.logprob, None, "stop" if ended else "length"))
        return outs
