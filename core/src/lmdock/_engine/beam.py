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

from collections.abc import Sequence
from dataclasses import dataclass, field

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
        """One step.

        :param outputs: each live beam's generated tokens so far.
        :param running: each live beam's sum of logprobs.
        :param logprobs: [beams, vocab] log-softmax (EOS already masked where it may not end).
        :param ends: [vocab] bool, the tokens that end a hypothesis (EOS, stop tokens).
        :param at_limit: the new token reaches the length limit: every candidate ends.
        :return: the next beams (empty when the search is over).
        """
        vocab = logprobs.shape[1]
        gen_len = len(outputs[0]) + 1
        flat = (running[:, None] + logprobs).ravel()
        k = min(2 * self.width, flat.size)
        top = np.argpartition(-flat, k - 1)[:k]
        top = top[np.argsort(-flat[top], kind="stable")]
        keep: list[Choice] = []
        for rank, f in enumerate(top.tolist()):
            beam, token = divmod(f, vocab)
            if at_limit or ends[token]:
                if rank < self.width and self.improvable and not (self.early_stopping and self._full()):
                    self._add([*outputs[beam], token], float(flat[f]), gen_len)
                continue
            if len(keep) < self.width:
                keep.append(Choice(beam, token, float(flat[f])))
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
