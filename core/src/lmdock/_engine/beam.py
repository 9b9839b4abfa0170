"""Beam search bookkeeping, with transformers' semantics (TensorRT-LLM's parameter names).

Each step: every live beam's log-softmax plus its running score gives ``beam_width x vocab``
candidates; the best ``2 * beam_width`` are taken in order.  A candidate that ends (EOS, or the length
limit) becomes a finished hypothesis if it ranks in the top ``beam_width``, scored
``sum_logprobs / generated_len ** length_penalty`` (the length counts the new token); the first
``beam_width`` candidates that do not end are the next beams.  The search stops when no running beam
can beat the worst of ``beam_width`` finished hypotheses (``early_stopping=False``, transformers'
heuristic), as soon as ``beam_width`` are finished (``early_stopping=True``), or at the length limit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Hypothesis:
    score: float
    token_ids: list[int]
    logprob: float


@dataclass
class Choice:
    beam: int
    token: int
    logprob: float  # the running sum


@dataclass
class BeamSearch:
    width: int
    length_penalty: float = 1.0
    early_stopping: bool = False
    hyps: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    def _add(self, token_ids: list[int], logprob: float, gen_len: int) -> None:
        score = logprob / (gen_len**self.length_penalty)
        self.hyps.append(Hypothesis(score, token_ids, logprob))
        self.hyps.sort(key=lambda h: -h.score)
        del self.hyps[self.width :]

    def step(
        self,
        outputs: Sequence[list[int]],
        running: np.ndarray,
        logprobs: np.ndarray,
        ends: np.ndarray,
        at_limit: bool,
    ) -> list[Choice]:
        """One step over dense log-probabilities.

        :param outputs: each live beam's generated tokens so far.
        :param running: each live beam's sum of logprobs.
        :param logprobs: [beams, vocab] log-softmax (EOS already masked where it may not end).
        :param ends: [vocab] bool, the tokens that end a hypothesis (EOS, stop tokens).
        :param at_limit: the new token reaches the length limit: every candidate ends.
        :return: the next beams (empty when the search is over).
        """
        vocab = logprobs.shape[1]
        flat = (running[:, None] + logprobs).ravel()
        k = min(2 * self.width, flat.size)
        top = np.argpartition(-flat, k - 1)[:k]
        top = top[np.argsort(-flat[top], kind="stable")]  # ties: beam, then token order
        ranked = [(float(flat[f]), *divmod(f, vocab)) for f in top.tolist()]
        return self.choose(ranked, outputs, lambda token: bool(ends[token]), at_limit)

    def step_top(
        self,
        outputs: Sequence[list[int]],
        running: Sequence[float],
        rows: Sequence[dict[int, float]],
        ends: Collection[int],
        at_limit: bool,
        mask_ends: bool,
    ) -> list[Choice]:
        """One step over each beam's top next-token logprobs (``rows[i]``: token -> logprob), as an
        engine that reports the top ``2 * width`` per row gives them (vLLM): those hold every candidate
        of the global top ``2 * width``.  ``mask_ends``: ending tokens may not end yet (min_new_tokens)."""
        ranked = sorted(
            ((run + lp, b, tok) for b, (run, row) in enumerate(zip(running, rows, strict=True))
             for tok, lp in row.items() if not (mask_ends and tok in ends)),
            key=lambda c: (-c[0], c[1], c[2]),  # as the dense step's stable sort of [beam, vocab]
        )
        return self.choose(ranked[: 2 * self.width], outputs, ends.__contains__, at_limit)

    def choose(
        self,
        ranked: Sequence[tuple[float, int, int]],
        outputs: Sequence[list[int]],
        is_end: Callable[[int], bool],
        at_limit: bool,
    ) -> list[Choice]:
        """The bookkeeping shared by both steps: ``ranked`` holds the best ``2 * width`` candidates,
        best first, as (running logprob, beam, token)."""
        gen_len = len(outputs[0]) + 1
        keep: list[Choice] = []
        for rank, (score, beam, token) in enumerate(ranked):
            if at_limit or is_end(token):
                if rank < self.width and self.improvable and not (self.early_stopping and self._full()):
                    self._add([*outputs[beam], token], score, gen_len)
                continue
            if len(keep) < self.width:
                keep.append(Choice(beam, token, score))
        if at_limit or not keep:
            self.done = True
            return []
        if self._full():
            if self.early_stopping:
                self.done = True
            else:
                best_possible = keep[0].logprob / (gen_len**self.length_penalty)
                self.improvable = best_possible > self.hyps[-1].score
                self.done = not self.improvable
        return [] if self.done else keep

    def _full(self) -> bool:
        return len(self.hyps) >= self.width


def beam_choices(beam: BeamSearch, params: Any, live: Sequence[Any], eos_token_ids: Sequence[int], max_seq_len: int) -> list[list[Choice]]:
    """One beam-search step for a request whose live beams all have this step's log-softmax
    (``beam_lp``): the children of each live beam (empty: the beam is pruned; the search may be done).

    EOS and stop tokens end a hypothesis (masked until ``min_new_tokens``); the length limit is
    ``max_new_tokens`` or the context.
    """
    lps = np.stack([s.beam_lp for s in live])
    ends = np.zeros(lps.shape[1], dtype=bool)
    ends[list(params.stop_token_ids)] = True
    if not params.ignore_eos:
        ends[list(eos_token_ids)] = True
    n_out = live[0].num_output
    if n_out < params.min_new_tokens:
        lps[:, ends] = -np.inf
    limit = params.max_new_tokens
    at_limit = (limit is not None and n_out + 1 >= limit) or len(live[0].token_ids) + 1 >= max_seq_len
    outputs = [s.token_ids[s.prompt_len :] for s in live]
    running = np.array([s.cumulative_logprob or 0.0 for s in live])
    children: list[list[Choice]] = [[] for _ in live]
    for c in beam.step(outputs, running, lps, ends, at_limit):
        children[c.beam].append(c)
    return children


#: SamplingParams fields beam search does not honour, with their neutral values: a request that sets
#: one is refused by name rather than silently ignored.
UNSUPPORTED_WITH_BEAMS = {
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_p": 0.0,
    "structured_output": None,
    "logprobs": None,
    "stop": (),
    "logit_bias": {},
    "allowed_token_ids": None,
    "bad_words": (),
}
