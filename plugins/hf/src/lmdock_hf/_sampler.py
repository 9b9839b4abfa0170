"""lmdock's sampling pipeline in torch, on the device the logits are on (issue 44).

The reference sampler (``lmdock._engine.sampler``) defines the semantics; this keeps its order:
raw logprobs, then ``allowed_token_ids`` / bad words / ``logit_bias``, penalties (only the tokens
seen), min_new_tokens, temperature, min_p, top_k then top_p (stable sorts: ties by token id) and one
uniform from the request's own NumPy generator inverted through the CDF in token-id order: the same
draw as the reference, so a seed gives the same tokens on both up to float rounding.  Only the
sampled ids and the logprob entries a request asked for cross to the host.

Rows with plugins' logits processors (NumPy callables) and logits that already are on the host
(NumPy) go to the reference sampler whole.  ``mode="auto"`` also gives it CPU tensors: there the
reference's partial selection beats a full sort, and reading a CPU tensor as NumPy copies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lmdock import RequestError
from lmdock.backend import ReferenceSampler, Sample, SampleRow


class TorchSampler:
    """``lmdock_make_sampler``'s answer for lmdock-hf.  ``mode``: ``"auto"`` (on the device where the
    logits live on an accelerator, the reference sampler for CPU tensors) or ``"torch"`` (always)."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode
        self.reference = ReferenceSampler()

    def sample(self, logits: Any, rows: Sequence[SampleRow]) -> list[Sample]:
        if not isinstance(logits, torch.Tensor) or any(r.processors for r in rows):
            return self.reference.sample(logits, rows)
        if self.mode == "auto" and logits.device.type == "cpu":
            return self.reference.sample(logits, rows)
        if not rows:
            return []
        return _sample(logits.float(), rows)


def _sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sample]:
    n = len(rows)
    fast = [r.plain and r.num_output >= r.params.min_new_tokens for r in rows]
    tokens = logits.argmax(dim=-1)
    rest = [i for i in range(n) if not fast[i]]
    if rest:
        tokens[rest] = _sample_rows(logits[rest], [rows[i] for i in rest])
    want = [i for i in range(n) if rows[i].params.logprobs is not None]
    ids = tokens.tolist()  # the one transfer every step makes: a token id per row
    out = [Sample(t) for t in ids]
    if want:
        for i, s in zip(want, _logprobs(logits[want], tokens[want], [rows[i].params.logprobs or 0 for i in want])):
            out[i] = s
    return out


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Steps 2-9 for the rows that need them."""
    x = logits.clone()
    for j, row in enumerate(rows):  # each step touches only its own row, so per row the order stays the reference's
        if row.bias is not None:
            _apply_bias(x[j], row)
    _apply_penalties(x, rows)
    for j, row in enumerate(rows):
        if row.num_output < row.params.min_new_tokens:
            banned = list(row.params.stop_token_ids) + list(row.eos_token_ids)
            if banned:
                x[j, banned] = -torch.inf
    tokens = x.argmax(dim=-1)
    sampled = [j for j, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = _distributions(x[sampled], [rows[j].params for j in sampled])
        wide = _wide(x.device)
        cdf = torch.cumsum(probs.to(wide), dim=-1)
        u = torch.tensor([[rows[j].rng.random()] for j in sampled], dtype=wide, device=x.device)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=x.shape[-1] - 1)
        tokens[sampled] = drawn[:, 0]
    return tokens


def _wide(device: torch.device) -> torch.dtype:
    """float64 for sums and the CDF, as the reference; float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _apply_bias(x: torch.Tensor, row: SampleRow) -> None:
    """Step 2 on one row: the reference's ``TokenBias`` with its masks kept on the device."""
    bias = row.bias
    assert bias is not None
    cached = getattr(bias, "_torch", None)
    if cached is None or cached[0] != x.device or cached[1].shape[0] != x.shape[0]:
        outside = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        if bias.allowed is not None:
            outside[torch.from_numpy(bias.allowed).to(x.device)] = False
        cached = (x.device, outside, torch.from_numpy(bias.bias_ids).to(x.device), torch.from_numpy(bias.bias_values).to(x.device))
        bias._torch = cached  # type: ignore[attr-defined]
    _, outside, ids, values = cached
    if bias.allowed is not None:
        x.masked_fill_(outside, -torch.inf)
    tokens, n_out = row.token_ids, row.num_output
    banned = [last for prefix, last in bias.bad_words
              if not prefix or (len(prefix) <= n_out and tokens[len(tokens) - len(prefix) :] == prefix)]
    if banned:
        x[banned] = -torch.inf
    if ids.numel():
        x.index_add_(0, ids, values)
    if not bool(torch.isfinite(x).any()):
        raise RequestError("allowed_token_ids and bad_words leave no token to generate next; allow more tokens")


def _apply_penalties(x: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Step 3 for every penalized row at once, only at the tokens each has seen (the reference's sparse
    tallies, moved over in one copy per penalty kind: a copy and a scatter per row cost a batch of 64 on
    a GPU ~7 ms a step, measured on an H200)."""
    rep = [(j, r) for j, r in enumerate(rows) if r.penalized and r.params.repetition_penalty != 1.0]
    if rep:
        seen = [r.seen_ids() for _, r in rep]
        at, ids = _flat([j for j, _ in rep], seen, x.device)
        pen = torch.from_numpy(np.repeat(np.array([r.params.repetition_penalty for _, r in rep], dtype=np.float32),
                                         [len(s) for s in seen])).to(x.device)
        vals = x[at, ids]
        x[at, ids] = torch.where(vals > 0, vals / pen, vals * pen)
    add = [(j, r) for j, r in enumerate(rows)
           if r.penalized and (r.params.frequency_penalty or r.params.presence_penalty) and r.num_output > 0]
    if add:
        tallies = [r.output_counts() for _, r in add]
        at, ids = _flat([j for j, _ in add], [t[0] for t in tallies], x.device)
        lens = [len(t[0]) for t in tallies]
        counts = np.concatenate([t[1] for t in tallies]).astype(np.float64)
        freq = np.repeat(np.array([r.params.frequency_penalty for _, r in add], dtype=np.float64), lens)
        pres = np.repeat(np.array([r.params.presence_penalty for _, r in add], dtype=np.float64), lens)
        wide = _wide(x.device)
        minus = torch.from_numpy(freq * counts + pres).to(x.device, wide)
        x[at, ids] = (x[at, ids].to(wide) - minus).float()


def _flat(rows: list[int], ids: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for advanced indexing, built on the host and copied once."""
    pairs = np.stack([np.repeat(np.array(rows, dtype=np.int64), [len(i) for i in ids]),
                      np.concatenate(ids).astype(np.int64)])
    at, tok = torch.from_numpy(pairs).to(device)
    return at, tok


def _distributions(x: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
    """Steps 6-8 for several rows: temperature, min_p, top_k, top_p (float32; sums and the CDF in float64 but on MPS)."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device)[:, None]
    probs = torch.softmax(x / temps, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=x.device)[:, None]
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    vocab = x.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    wide = _wide(x.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=wide, device=x.device)[:, None]
    if min(top_k) < vocab or bool((top_p < 1.0).any()):
        # stable: equal probabilities keep token-id order, as the reference breaks ties
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        sorted_p = sorted_p.masked_fill(rank >= torch.tensor(top_k, device=x.device)[:, None], 0.0)
        sp = sorted_p.to(wide) / sorted_p.to(wide).sum(dim=-1, keepdim=True)
        before = torch.cumsum(sp, dim=-1) - sp  # the mass of the more likely tokens
        sorted_p = sorted_p.masked_fill((before >= top_p) & (top_p < 1.0), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[Sample]:
    """The raw logprob of each row's token, its rank and the k best, computed on the device; only
    those numbers come back."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(-1, tokens[:, None])
    rank = (lp > chosen).sum(dim=-1) + 1
    k = max(ks)
    if k > 0:
        top_v, top_i = torch.sort(lp, dim=-1, descending=True, stable=True)
        top_v, top_i = top_v[:, :k].tolist(), top_i[:, :k].tolist()
    out = []
    for j, (t, c, r) in enumerate(zip(tokens.tolist(), chosen[:, 0].tolist(), rank.tolist())):
        top = list(zip(top_i[j][: ks[j]], top_v[j][: ks[j]])) if k > 0 else []
        out.append(Sample(int(t), float(c), int(r), top))
    return out

