"""lmdock's sampling pipeline in MLX, where the engine's logits are (issue 44).

The reference sampler (``lmdock._engine.sampler``) defines the semantics; this keeps its order:
raw logprobs, then ``allowed_token_ids`` / bad words / ``logit_bias``, penalties (only the tokens
seen), min_new_tokens, temperature, min_p, top_k then top_p (MLX's sort is stable: ties by token
id) and one uniform from the request's own NumPy generator inverted through the CDF in token-id
order: the reference's draw, so a seed gives the same tokens on both up to float rounding (MLX
computes the CDF in float32: it has no float64 on the GPU).  Only the sampled ids and the logprob
entries a request asked for come back as Python numbers.

Rows with plugins' logits processors (NumPy callables), and logits that already are NumPy, go to
the reference sampler whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from lmdock import RequestError
from lmdock.backend import ReferenceSampler, Sample, SampleRow


class MlxSampler:
    """``lmdock_make_sampler``'s answer for lmdock-mlx."""

    def __init__(self) -> None:
        self.reference = ReferenceSampler()

    def sample(self, logits: Any, rows: Sequence[SampleRow]) -> list[Sample]:
        if not isinstance(logits, mx.array) or any(r.processors for r in rows):
            return self.reference.sample(logits, rows)
        if not rows:
            return []
        return _sample(logits.astype(mx.float32), rows)


def _sample(logits: mx.array, rows: Sequence[SampleRow]) -> list[Sample]:
    n = len(rows)
    fast = [r.plain and r.num_output >= r.params.min_new_tokens for r in rows]
    tokens = mx.argmax(logits, axis=-1)
    rest = [i for i in range(n) if not fast[i]]
    if rest:
        tokens[mx.array(rest)] = _sample_rows(logits[mx.array(rest)], [rows[i] for i in rest])
    want = [i for i in range(n) if rows[i].params.logprobs is not None]
    out = [Sample(int(t)) for t in tokens.tolist()]  # the one transfer every step makes
    if want:
        picked = mx.array(want)
        for i, s in zip(want, _logprobs(logits[picked], tokens[picked], [rows[i].params.logprobs or 0 for i in want])):
            out[i] = s
    return out


def _sample_rows(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    """Steps 2-9 for the rows that need them."""
    x_rows = [logits[j] for j in range(len(rows))]
    for j, row in enumerate(rows):
        x = x_rows[j]
        if row.bias is not None:
            x = _apply_bias(x, row)
        if row.penalized:
            x = _apply_penalties(x, row)
        if row.num_output < row.params.min_new_tokens:
            banned = list(row.params.stop_token_ids) + list(row.eos_token_ids)
            if banned:
                x[mx.array(banned)] = -mx.inf
        x_rows[j] = x
    x = mx.stack(x_rows)
    tokens = mx.argmax(x, axis=-1)
    sampled = [j for j, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        picked = mx.array(sampled)
        probs = _distributions(x[picked], [rows[j].params for j in sampled])
        cdf = mx.cumsum(probs, axis=-1)
        u = mx.array([[rows[j].rng.random()] for j in sampled], dtype=mx.float32) * cdf[:, -1:]
        drawn = mx.minimum(mx.sum(cdf <= u, axis=-1), x.shape[-1] - 1)  # searchsorted(side="right")
        tokens[picked] = drawn.astype(tokens.dtype)
    return tokens


def _apply_bias(x: mx.array, row: SampleRow) -> mx.array:
    """Step 2 on one row: the reference's ``TokenBias``, its masks kept as MLX arrays."""
    bias = row.bias
    assert bias is not None
    cached = getattr(bias, "_mlx", None)
    if cached is None or cached[0].shape[0] != x.shape[0]:
        inside = mx.zeros((x.shape[0],), dtype=mx.bool_)
        if bias.allowed is not None:
            inside[mx.array(bias.allowed)] = True
        cached = (inside, mx.array(bias.bias_ids), mx.array(bias.bias_values))
        bias._mlx = cached  # type: ignore[attr-defined]
    inside, ids, values = cached
    if bias.allowed is not None:
        x = mx.where(inside, x, -mx.inf)
    tokens, n_out = row.token_ids, row.num_output
    banned = [last for prefix, last in bias.bad_words
              if not prefix or (len(prefix) <= n_out and tokens[len(tokens) - len(prefix) :] == prefix)]
    if banned:
        x[mx.array(banned)] = -mx.inf
    if ids.size:
        x = x.at[ids].add(values)
    if not mx.any(mx.isfinite(x)).item():
        raise RequestError("allowed_token_ids and bad_words leave no token to generate next; allow more tokens")
    return x


def _apply_penalties(x: mx.array, row: SampleRow) -> mx.array:
    """Step 3 on one row, only at the tokens seen (the reference's sparse tallies, moved over)."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = mx.array(row.seen_ids())
        vals = x[seen]
        x[seen] = mx.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.num_output > 0:
        ids_np, counts_np = row.output_counts()
        ids = mx.array(ids_np)
        x[ids] = x[ids] - (p.frequency_penalty * mx.array(counts_np).astype(mx.float32) + p.presence_penalty)
    return x


def _distributions(x: mx.array, params: Sequence[Any]) -> mx.array:
    """Steps 6-8 for several rows: temperature, min_p, top_k, top_p."""
    temps = mx.array([p.temperature for p in params], dtype=mx.float32)[:, None]
    probs = mx.softmax(x / temps, axis=-1)
    min_p = mx.array([p.min_p for p in params], dtype=mx.float32)[:, None]
    if any(p.min_p > 0 for p in params):
        probs = mx.where(probs < min_p * mx.max(probs, axis=-1, keepdims=True), 0.0, probs)
    vocab = x.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab or any(p.top_p < 1.0 for p in params):
        order = mx.argsort(-probs, axis=-1)  # stable: equal probabilities keep token-id order
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        rank = mx.arange(vocab)[None, :]
        sorted_p = mx.where(rank >= mx.array(top_k)[:, None], 0.0, sorted_p)
        sp = sorted_p / mx.sum(sorted_p, axis=-1, keepdims=True)
        before = mx.cumsum(sp, axis=-1) - sp  # the mass of the more likely tokens
        top_p = mx.array([p.top_p for p in params], dtype=mx.float32)[:, None]
        sorted_p = mx.where((before >= top_p) & (top_p < 1.0), 0.0, sorted_p)
        probs = mx.put_along_axis(mx.zeros_like(probs), order, sorted_p, axis=-1)
    return probs


def _logprobs(logits: mx.array, tokens: mx.array, ks: list[int]) -> list[Sample]:
    """The raw logprob of each row's token, its rank and the k best; only those numbers come back."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None].astype(mx.int32), axis=-1)
    rank = mx.sum(lp > chosen, axis=-1) + 1
    k = max(ks)
    top_i: list[list[int]] = [[] for _ in ks]
    top_v: list[list[float]] = [[] for _ in ks]
    if k > 0:
        order = mx.argsort(-lp, axis=-1)[:, :k]
        top_i, top_v = order.tolist(), mx.take_along_axis(lp, order, axis=-1).tolist()
    return [Sample(int(t), float(c), int(r), list(zip(top_i[j][: ks[j]], top_v[j][: ks[j]])))
            for j, (t, c, r) in enumerate(zip(tokens.tolist(), chosen[:, 0].tolist(), rank.tolist()))]
