"""Beam search over vLLM, the way ``vllm.LLM.beam_search`` does it: every step, each live beam is one
vLLM request for one token with ``logprobs = 2 * beam_width`` (plus the ending tokens), and vLLM's
prefix cache keeps the shared prompt and history computed once.

The bookkeeping follows transformers' semantics (the same as lmdock's core beam search): the best
``2 * beam_width`` candidates over all beams are taken in order; a candidate that ends (EOS, a stop
token, the length limit) becomes a finished hypothesis if it ranks in the top ``beam_width``, scored
``sum_logprobs / generated_len ** length_penalty``; the first ``beam_width`` candidates that do not end
are the next beams.  The search stops when no running beam can beat the worst of ``beam_width``
finished hypotheses (``early_stopping=False``), as soon as ``beam_width`` are finished
(``early_stopping=True``), or at the length limit.  The top ``2 * beam_width`` of each beam hold every
candidate of the global top ``2 * beam_width``, so vLLM's top-k logprobs are enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    score: float
    token_ids: list[int]
    logprob: float


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    logprob: float  # running sum


@dataclass
class BeamSearch:
    width: int
    length_penalty: float = 1.0
    early_stopping: bool = False
    hyps: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    def _full(self) -> bool:
        return len(self.hyps) >= self.width

    def _add(self, token_ids: list[int], logprob: float, gen_len: int) -> None:
        self.hyps.append(Hypothesis(logprob / (gen_len**self.length_penalty), token_ids, logprob))
        self.hyps.sort(key=lambda h: -h.score)
        del self.hyps[self.width :]

    def step(self, beams: Sequence[Beam], rows: Sequence[dict[int, float]], ends: frozenset[int], at_limit: bool, mask_ends: bool) -> list[Beam]:
        """One step: ``rows[i]`` holds beam i's top next-token logprobs.  Returns the next beams
        (empty when the search is over)."""
        gen_len = len(beams[0].token_ids) + 1
        cands = [
            (beam.logprob + lp, b, tok)
            for b, (beam, row) in enumerate(zip(beams, rows, strict=True))
            for tok, lp in row.items()
            if not (mask_ends and tok in ends)
        ]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))  # as a stable sort of the flat [beam, vocab] scores
        keep: list[Beam] = []
        for rank, (score, b, tok) in enumerate(cands[: 2 * self.width]):
            if at_limit or tok in ends:
                if rank < self.width and self.improvable and not (self.early_stopping and self._full()):
                    self._add([*beams[b].token_ids, tok], score, gen_len)
                continue
            if len(keep) < self.width:
                keep.append(Beam([*beams[b].token_ids, tok], score))
        if at_limit or not keep:
            self.done = True
            return []
        if self._full():
            if self.early_stopping:
                self.done = True
            else:
                self.improvable = keep[0].logprob / (gen_len**self.length_penalty) > self.hyps[-1].score
                self.done = not self.improvable
        return [] if self.done else keep
