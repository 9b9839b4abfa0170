"""The reference sampler: turns one step's logits into tokens with MAX / vLLM semantics.

Pipeline, per row (the order is part of the contract; every backend's native sampler must keep it):

1. raw logprobs: ``log_softmax`` of the model's logits, for ``logprobs`` and beam search;
2. penalties: repetition (prompt and output; divide positive logits, multiply negative ones),
   frequency (times the count in the output) and presence (once per token seen in the output);
3. logits processors contributed by plugins (``lmdock_logits_processors``), in registration order;
4. min_new_tokens: EOS and stop tokens masked until the output is long enough;
5. temperature (0 means greedy: argmax of the processed logits);
6. min_p: drop tokens below ``min_p`` times the top probability;
7. top_k, then top_p over what is left, renormalised;
8. one draw from the request's own generator, seeded from ``(seed, completion index)``, so a
   request's samples never depend on what else is in the batch.

Rows that are plain greedy (no penalties, no processors, nothing to mask) skip 2-8 and share one
vectorised argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from lmdock._params import SamplingParams

LogitsProcessor = Callable[[list[int], np.ndarray], np.ndarray]


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    rng: np.random.Generator
    eos_token_ids: tuple[int, ...] = ()
    processors: Sequence[LogitsProcessor] = ()

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler(Protocol):
    def sample(self, logits: np.ndarray, rows: Sequence[SampleRow]) -> list[Sample]: ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, in float32 (float64 inside)."""
    x = logits.astype(np.float64, copy=False)
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return (x - lse).astype(np.float32)


def apply_penalties(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """Step 2, in place on a float32 row."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(row.token_ids, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.num_output > 0:
        counts = np.bincount(np.asarray(row.token_ids[row.prompt_len :], dtype=np.int64), minlength=logits.shape[-1])
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def mask_min_tokens(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """Step 4, in place: no EOS or stop token before ``min_new_tokens`` output tokens."""
    if row.num_output < row.params.min_new_tokens:
        banned = list(row.params.stop_token_ids) + list(row.eos_token_ids)
        if banned:
            logits[banned] = -np.inf
    return logits


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Steps 5-7: the exact probabilities a non-greedy draw uses (float64, sums to 1)."""
    x = logits.astype(np.float64) / params.temperature
    x -= x.max()
    probs = np.exp(x)
    probs /= probs.sum()
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    if 0 < params.top_k < probs.shape[-1]:
        # keep exactly top_k: ties at the threshold are broken by index, like a stable sort
        order = np.argsort(-probs, kind="stable")
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[: params.top_k]] = True
        probs[~keep] = 0.0
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_p = probs[order] / probs.sum()
        before = np.cumsum(sorted_p) - sorted_p  # mass of strictly more likely tokens
        probs[order[before >= params.top_p]] = 0.0
    return probs / probs.sum()


def _needs_processing(row: SampleRow) -> bool:
    p = row.params
    return bool(
        p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
        or row.processors
        or row.num_output < p.min_new_tokens
    )


class ReferenceSampler:
    """The NumPy sampler that defines lmdock's sampling semantics."""

    def sample(self, logits: np.ndarray, rows: Sequence[SampleRow]) -> list[Sample]:
        n = len(rows)
        if n == 0:
            return []
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_lp = log_softmax(logits) if any(want_lp) else None
        fast = [r.params.greedy and not _needs_processing(r) for r in rows]
        tokens = np.empty(n, dtype=np.int64)
        if all(fast):
            tokens[:] = logits.argmax(axis=-1)
        else:
            for i, row in enumerate(rows):
                tokens[i] = int(logits[i].argmax()) if fast[i] else self._sample_row(logits[i], row)
        out = []
        for i, row in enumerate(rows):
            tok = int(tokens[i])
            if raw_lp is None or not want_lp[i]:
                out.append(Sample(tok))
                continue
            out.append(_with_logprobs(tok, raw_lp[i], row.params.logprobs or 0))
        return out

    def _sample_row(self, row_logits: np.ndarray, row: SampleRow) -> int:
        x = np.array(row_logits, dtype=np.float32, copy=True)
        apply_penalties(x, row)
        for proc in row.processors:
            x = proc(row.token_ids, x)
        mask_min_tokens(x, row)
        if row.params.greedy:
            return int(x.argmax())
        probs = distribution(x, row.params)
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, row.rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def _with_logprobs(token: int, lp: np.ndarray, k: int) -> Sample:
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = np.argpartition(-lp, min(k, lp.shape[-1] - 1))[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(int(t), float(lp[t])) for t in idx]
    return Sample(token, chosen, rank, top)
