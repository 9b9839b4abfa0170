"""The reference sampler: turns one step's logits into tokens with MAX / vLLM semantics.

Pipeline, per row (the order is part of the contract; every backend's native sampler must keep it):

1. raw logprobs: ``log_softmax`` of the model's logits, for ``logprobs`` and beam search;
2. ``allowed_token_ids``, ``bad_words``, then ``logit_bias`` (vLLM's order:
   :class:`lmdock._engine.biases.TokenBias`);
3. penalties: repetition (prompt and output; divide positive logits, multiply negative ones),
   frequency (times the count in the output) and presence (once per token seen in the output);
4. logits processors contributed by plugins (``lmdock_logits_processors``), in registration order;
5. min_new_tokens: EOS and stop tokens masked until the output is long enough;
6. temperature (0 means greedy: argmax of the processed logits);
7. min_p: drop tokens below ``min_p`` times the top probability;
8. top_k, then top_p over what is left, renormalised;
9. one draw from the request's own generator, seeded from ``(seed, completion index)``, so a
   request's samples never depend on what else is in the batch.

The cost follows the work, not the vocabulary (issue 44).  The path is chosen once per step from
batch-wide flags.  Rows that are plain greedy (no biases, no penalties, no processors, nothing to
mask, no logprobs) share one argmax.  The other rows: penalties touch only the tokens seen, from
counts kept incrementally; greedy rows take the argmax of what that leaves; sampled rows get one
batch-wide ``exp`` (temperature, the total mass, min_p as a threshold), then top_k and top_p as a
partial selection (:mod:`lmdock._engine.selection`: a sampled bracket of the boundary, a sort of the
last few hundred candidates only), and the draw is an inverse CDF over the kept tokens in token-id
order.  Up to ``FULL_SORT_VOCAB`` tokens a row, whole-row sorts over all rows at once are cheaper
(fewer NumPy calls) and give the same kept sets.
Logprobs are computed for the rows that asked, their top entries by the same selection.  Per-row
Python remains for biases, plugins' logits processors and the selection itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lmdock._engine.biases import TokenBias
from lmdock._engine.selection import boundary, kept_mask, top_indices

if TYPE_CHECKING:
    from lmdock._config.sampling import SamplingParams

LogitsProcessor = Callable[[list[int], np.ndarray], np.ndarray]


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence.  ``bad_words_ids``: the token sequences
    of ``params.bad_words`` (:func:`lmdock._engine.biases.bad_words_ids`, which needs the tokenizer)."""

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    rng: np.random.Generator
    eos_token_ids: tuple[int, ...] = ()
    processors: Sequence[LogitsProcessor] = ()
    bad_words_ids: Sequence[Sequence[int]] = ()

    def __post_init__(self) -> None:
        p = self.params
        if p.bad_words and not self.bad_words_ids:
            raise ValueError("SampleRow: params.bad_words needs bad_words_ids, their token sequences "
                             "(lmdock._engine.biases.bad_words_ids)")
        self.penalized = p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
        #: allowed_token_ids, bad_words and logit_bias, or None
        self.bias = TokenBias(p, self.bad_words_ids) if p.biased else None
        #: greedy with nothing that could change the argmax (min_new_tokens aside, checked per step)
        self.plain = p.greedy and not self.penalized and not self.processors and self.bias is None
        self._tally = TokenTally()  # the output's tokens
        self._seen = TokenTally()  # prompt and output tokens, for the repetition penalty
        self._counted = self._seen_upto = -1

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct output tokens and how often each occurs (kept up to date incrementally)."""
        if self._counted < 0:
            self._counted = self.prompt_len
        self._counted = self._tally.add(self.token_ids, self._counted)
        return self._tally.ids(), self._tally.counts()

    def seen_ids(self) -> np.ndarray:
        """The distinct tokens of the prompt and the output (for the repetition penalty)."""
        self._seen_upto = self._seen.add(self.token_ids, max(self._seen_upto, 0))
        return self._seen.ids()


class TokenTally:
    """Distinct token ids in first-seen order with their counts, grown one token at a time: the
    sparse counts the penalties read (a sequence sees a few hundred distinct tokens, not the vocabulary)."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self._ids = np.zeros(16, dtype=np.int64)
        self._counts = np.zeros(16, dtype=np.int64)

    def add(self, tokens: list[int], start: int) -> int:
        """Count ``tokens[start:]``; returns where the next call starts."""
        for t in tokens[start:]:
            j = self._slot.get(t)
            if j is None:
                j = self._slot[t] = len(self._slot)
                if j == self._ids.shape[0]:
                    self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
                self._ids[j] = t
            self._counts[j] += 1
        return len(tokens)

    def ids(self) -> np.ndarray:
        return self._ids[: len(self._slot)]

    def counts(self) -> np.ndarray:
        return self._counts[: len(self._slot)]


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler(Protocol):
    def sample(self, logits: Any, rows: Sequence[SampleRow]) -> list[Sample]: ...


def host_array(logits: Any) -> np.ndarray:
    """Logits as a float32 NumPy array: an engine may return its own array type (a torch tensor,
    an MLX array) for a native sampler; the core's host-side steps read them through this."""
    if isinstance(logits, np.ndarray):
        return logits
    if hasattr(logits, "detach"):  # torch: off the device first (np.asarray cannot read CUDA memory)
        logits = logits.detach().float().cpu()
    return np.asarray(logits, dtype=np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, in float32 (the sum in float64; ``exp`` in
    float32, whose SIMD form is ~25x faster than float64's and exact to ~1e-7 relative)."""
    m = logits.max(axis=-1, keepdims=True).astype(np.float64)
    shifted = (logits - m).astype(np.float32)
    lse = m + np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64))
    return (logits.astype(np.float64) - lse).astype(np.float32)


def apply_penalties(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """Step 3, in place on a float32 row, touching only the tokens seen: the repetition penalty in
    float32 over the prompt's and output's tokens, frequency and presence in float64 over the output's."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = row.seen_ids()
        vals = logits[seen]
        r = np.float32(p.repetition_penalty)
        logits[seen] = np.where(vals > 0, vals / r, vals * r)
    if (p.frequency_penalty or p.presence_penalty) and row.num_output > 0:
        ids, counts = row.output_counts()
        sub = logits[ids].astype(np.float64) - (p.frequency_penalty * counts + p.presence_penalty)
        logits[ids] = sub.astype(np.float32)
    return logits


def mask_min_tokens(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """Step 5, in place: no EOS or stop token before ``min_new_tokens`` output tokens."""
    if row.num_output < row.params.min_new_tokens:
        banned = list(row.params.stop_token_ids) + list(row.eos_token_ids)
        if banned:
            logits[banned] = -np.inf
    return logits


class ReferenceSampler:
    """The NumPy sampler that defines lmdock's sampling semantics."""

    def sample(self, logits: Any, rows: Sequence[SampleRow]) -> list[Sample]:
        n = len(rows)
        if n == 0:
            return []
        logits = host_array(logits)
        want_lp = [r.params.logprobs is not None for r in rows]
        fast = [r.plain and r.num_output >= r.params.min_new_tokens for r in rows]
        if all(fast):
            tokens = logits.argmax(axis=-1).tolist()
        else:
            tokens = [0] * n
            plain = [i for i in range(n) if fast[i]]
            rest = [i for i in range(n) if not fast[i]]
            if plain:
                for i, t in zip(plain, logits[plain].argmax(axis=-1).tolist()):
                    tokens[i] = t
            for i, t in zip(rest, self._sample_rows(logits[rest], [rows[i] for i in rest])):
                tokens[i] = t
        if not any(want_lp):
            return [Sample(t) for t in tokens]
        return [with_logprobs(tokens[i], logits[i], row.params.logprobs or 0) if want_lp[i] else Sample(tokens[i])
                for i, row in enumerate(rows)]

    def _sample_rows(self, logits: np.ndarray, rows: list[SampleRow]) -> list[int]:
        """Steps 2-9 for rows that need them."""
        x = np.array(logits, dtype=np.float32, copy=True)
        for j, row in enumerate(rows):
            if row.bias is not None:
                row.bias.apply(x[j], row.token_ids, row.num_output)
            if row.penalized:
                apply_penalties(x[j], row)
            for proc in row.processors:
                x[j] = proc(row.token_ids, x[j])
            if row.num_output < row.params.min_new_tokens:
                mask_min_tokens(x[j], row)
        if x.shape[-1] <= FULL_SORT_VOCAB:  # a small vocabulary: whole-row NumPy over all rows at once
            return _sample_small(x, rows)
        tokens = [0] * len(rows)
        for j, row in enumerate(rows):  # row by row: each row's passes stay in the cache
            if row.params.greedy:
                tokens[j] = int(x[j].argmax())
            else:
                y, e = scaled_weights(x[j], row.params)
                ids, w = kept_tokens(y, e, row.params)
                tokens[j] = draw(ids, w, row.rng)
        return tokens


#: Up to this many tokens a row, steps 6-9 sort whole rows, batch-wide: fewer NumPy calls per row
#: than the partial selection, whose per-call overhead dominates there (stories260K: 512 tokens).
FULL_SORT_VOCAB = 4096


def _sample_small(x: np.ndarray, rows: list[SampleRow]) -> list[int]:
    """Steps 6-9 for a small vocabulary: the same kept sets and draws as :func:`kept_tokens` and
    :func:`draw`, by stable sorts of whole rows over all sampled rows at once."""
    tokens = x.argmax(axis=-1)
    sampled = [j for j, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = full_sort_distributions(x[sampled], [rows[j].params for j in sampled])
        cdf = np.cumsum(probs, axis=-1)
        u = np.array([rows[j].rng.random() for j in sampled]) * cdf[:, -1]
        drawn = (cdf <= u[:, None]).sum(axis=-1)  # searchsorted(side="right")
        last = x.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)  # u rounded up to the total
        tokens[sampled] = np.minimum(drawn, last)
    return tokens.tolist()


def full_sort_distributions(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Steps 6-8 for several rows by whole-row stable sorts (float64; each row sums to 1)."""
    temps = np.array([p.temperature for p in params], dtype=np.float64)[:, None]
    x = logits.astype(np.float64) / temps
    x -= x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    min_p = np.array([p.min_p for p in params])
    if (min_p > 0).any():
        probs[probs < (min_p[:, None] * probs.max(axis=-1, keepdims=True))] = 0.0
    top_k = [p.top_k for p in params]
    top_p = np.array([p.top_p for p in params])
    vocab = probs.shape[-1]
    limited = [j for j, k in enumerate(top_k) if 0 < k < vocab]
    if limited:
        order = np.argsort(-probs[limited], axis=-1, kind="stable")
        for i, j in enumerate(limited):
            probs[j, order[i, top_k[j] :]] = 0.0
    if (top_p < 1.0).any():
        sel = np.nonzero(top_p < 1.0)[0]
        sub = probs[sel]
        order = np.argsort(-sub, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(sub, order, axis=-1)
        sorted_p /= sorted_p.sum(axis=-1, keepdims=True)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of strictly more likely tokens
        np.put_along_axis(sub, order, np.where(before >= top_p[sel, None], 0.0, np.take_along_axis(sub, order, axis=-1)), axis=-1)
        probs[sel] = sub
    return probs / probs.sum(axis=-1, keepdims=True)


def scaled_weights(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Steps 6-7 on one row, in place: ``y = (x - max) / temperature`` and the unnormalised
    probabilities ``exp(y)`` (float32; the largest is 1), with min_p's dropped tokens at -inf / 0
    (``p < min_p * p_max`` is ``exp(y) < min_p``)."""
    y = x
    y -= y.max()
    y *= np.float32(1.0 / params.temperature)
    e = np.exp(y)
    if params.min_p > 0.0:
        drop = e < np.float32(params.min_p)
        e[drop] = 0.0
        y[drop] = -np.inf
    return y, e


def kept_tokens(y: np.ndarray, e: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Step 8 on one row: the token ids top_k and top_p keep (ascending) and their weights."""
    vocab = y.shape[-1]
    if 0 < params.top_k < vocab:
        ids = top_indices(y, params.top_k)  # exactly top_k, ties by index
        ids = np.sort(ids)
        w = e[ids]
        if params.top_p < 1.0:  # over the top_k left: a few dozen tokens, sorted plainly
            value, ties = boundary(y[ids], w, params.top_p * float(w.sum(dtype=np.float64)))
            keep = kept_mask(y[ids], value, ties)
            ids, w = ids[keep], w[keep]
        return ids, w
    if params.top_p < 1.0:
        total = float(e.sum())  # float32 pairwise: ~1e-6 relative, and 2x faster than in float64
        value, ties = boundary(y, e, params.top_p * total, total)
        ids = np.flatnonzero(kept_mask(y, value, ties))
        return ids, e[ids]
    ids = np.flatnonzero(e)
    return ids, e[ids]


def draw(ids: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> int:
    """Step 9: one uniform from the row's generator, inverted through the kept tokens' CDF in
    token-id order (the same draw a CDF over the whole vocabulary gives: the others weigh 0)."""
    cdf = np.cumsum(weights, dtype=np.float64)
    u = rng.random() * cdf[-1]
    pos = int(np.searchsorted(cdf, u, side="right"))
    if pos >= ids.shape[0]:  # u rounded up to the total: the last token that weighs anything
        pos = int(np.flatnonzero(weights)[-1])
    return int(ids[pos])


def with_logprobs(token: int, logits: np.ndarray, k: int) -> Sample:
    """The raw logprob of ``token``, its rank, and the ``k`` most likely tokens, from one row."""
    lp = log_softmax(logits[None, :])[0]
    chosen = float(lp[token])
    rank = int(np.count_nonzero(lp > lp[token])) + 1
    top = [(int(t), float(lp[t])) for t in top_indices(lp, k)] if k > 0 else []
    return Sample(token, chosen, rank, top)
