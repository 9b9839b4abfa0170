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

The work is batch-wide, as vLLM's sampler does it: the path is chosen once per step from batch-wide
flags.  Rows that are plain greedy (no biases, no penalties, no processors, nothing to mask, no
logprobs) share one argmax; the other rows get penalties from token counts kept incrementally, then
temperature, min_p, top_k, top_p and the draw as NumPy operations over all of them at once.  Per-row
Python remains only for biases, plugins' logits processors and the logprob entries a row asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lmdock._engine.biases import TokenBias

if TYPE_CHECKING:
    from lmdock._params import SamplingParams

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
        self._counts: np.ndarray | None = None
        self._counted = 0
        self._seen: np.ndarray | None = None

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def counts(self, vocab: int) -> np.ndarray:
        """How often each token occurs in the output (kept up to date incrementally)."""
        if self._counts is None or self._counts.shape[0] != vocab:
            self._counts = np.zeros(vocab, dtype=np.int64)
            self._counted = self.prompt_len
        new = self.token_ids[self._counted :]
        if new:
            np.add.at(self._counts, np.asarray(new, dtype=np.int64), 1)
            if self._seen is not None:
                self._seen[np.asarray(new, dtype=np.int64)] = True
            self._counted = len(self.token_ids)
        return self._counts

    def seen(self, vocab: int) -> np.ndarray:
        """Tokens that occur in the prompt or the output (for the repetition penalty)."""
        counts = self.counts(vocab)
        if self._seen is None or self._seen.shape[0] != vocab:
            self._seen = np.zeros(vocab, dtype=bool)
            self._seen[np.asarray(self.token_ids[: self.prompt_len], dtype=np.int64)] = True
            self._seen |= counts > 0
        return self._seen


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
    """Step 3, in place on a float32 row."""
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
    """Step 5, in place: no EOS or stop token before ``min_new_tokens`` output tokens."""
    if row.num_output < row.params.min_new_tokens:
        banned = list(row.params.stop_token_ids) + list(row.eos_token_ids)
        if banned:
            logits[banned] = -np.inf
    return logits


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Steps 6-8: the exact probabilities a non-greedy draw uses (float64, sums to 1)."""
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


class ReferenceSampler:
    """The NumPy sampler that defines lmdock's sampling semantics."""

    def sample(self, logits: np.ndarray, rows: Sequence[SampleRow]) -> list[Sample]:
        n = len(rows)
        if n == 0:
            return []
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
        raw_lp = log_softmax(logits[[i for i in range(n) if want_lp[i]]])
        out = []
        j = 0
        for i, row in enumerate(rows):
            if not want_lp[i]:
                out.append(Sample(tokens[i]))
                continue
            out.append(_with_logprobs(tokens[i], raw_lp[j], row.params.logprobs or 0))
            j += 1
        return out

    def _sample_rows(self, logits: np.ndarray, rows: list[SampleRow]) -> list[int]:
        """Steps 2-9 for rows that need them, vectorised over the rows."""
        x = np.array(logits, dtype=np.float32, copy=True)
        vocab = x.shape[1]
        for j, row in enumerate(rows):
            if row.bias is not None:
                row.bias.apply(x[j], row.token_ids, row.num_output)
        pen = [j for j, r in enumerate(rows) if r.penalized]
        if pen:
            x[pen] = _penalties([rows[j] for j in pen], x[pen], vocab)
        for j, row in enumerate(rows):
            for proc in row.processors:
                x[j] = proc(row.token_ids, x[j])
            if row.num_output < row.params.min_new_tokens:
                mask_min_tokens(x[j], row)
        tokens = x.argmax(axis=-1)
        sampled = [j for j, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            probs = distributions(x[sampled], [rows[j].params for j in sampled])
            cdf = np.cumsum(probs, axis=-1)
            u = np.array([rows[j].rng.random() for j in sampled]) * cdf[:, -1]
            drawn = np.minimum((cdf <= u[:, None]).sum(axis=-1), vocab - 1)  # searchsorted(side="right")
            tokens[sampled] = drawn
        return tokens.tolist()


def _penalties(rows: list[SampleRow], x: np.ndarray, vocab: int) -> np.ndarray:
    """Step 3 for several rows at once, from incrementally kept counts: each row as ``apply_penalties``
    computes it (float32 for the repetition penalty, float64 for frequency and presence)."""
    rep = np.array([r.params.repetition_penalty for r in rows], dtype=np.float32)
    if (rep != 1.0).any():
        seen = np.stack([r.seen(vocab) if rep[j] != 1.0 else np.zeros(vocab, dtype=bool) for j, r in enumerate(rows)])
        r = rep[:, None]
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    freq = np.array([r.params.frequency_penalty for r in rows])
    pres = np.array([r.params.presence_penalty for r in rows])
    if freq.any() or pres.any():
        counts = np.stack([r.counts(vocab) for r in rows])
        x = x.astype(np.float64, copy=False)
        x = (x - (freq[:, None] * counts + pres[:, None] * (counts > 0))).astype(np.float32)
    return x


def distributions(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Steps 6-8 for several rows at once: each row's :func:`distribution`."""
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
        rows = np.nonzero(top_p < 1.0)[0]
        sub = probs[rows]
        order = np.argsort(-sub, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(sub, order, axis=-1)
        sorted_p /= sorted_p.sum(axis=-1, keepdims=True)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of strictly more likely tokens
        np.put_along_axis(sub, order, np.where(before >= top_p[rows, None], 0.0, np.take_along_axis(sub, order, axis=-1)), axis=-1)
        probs[rows] = sub
    return probs / probs.sum(axis=-1, keepdims=True)


def _with_logprobs(token: int, lp: np.ndarray, k: int) -> Sample:
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = np.argpartition(-lp, min(k, lp.shape[-1] - 1))[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(int(t), float(lp[t])) for t in idx]
    return Sample(token, chosen, rank, top)
