"""Sliding-window layers keep only their window: a ring of positions per slot.

A layer with window ``W`` lets a query at position ``q`` see keys ``q - W < k <= q``
(``lmdock_hf._attention``), so nothing older than ``W - 1`` positions is ever read again.  The slot
cache (``lmdock_hf._cache``) gives such a layer ``[slots, kv_heads, min(W, capacity), head_dim]``
instead of the full context: position ``p`` lives in entry ``p % W``, and a row holds the last ``W``
positions its sequence wrote (vLLM's hybrid KV cache manager frees a sliding layer's blocks once they
leave the window; transformers' ``DynamicSlidingWindowLayer`` keeps the last ``W - 1`` keys; a ring
keeps the slot layout, so slot compaction and forks stay row copies).  Per forward:

1. decode (one token a row): each row writes its token into its entry, then attention reads the
   whole ring of every row (a view of the slots where the rows are contiguous, as for full layers);
2. a prefill chunk of ``w`` tokens from position ``a > 0``: attention reads the ring as it stood
   (positions ``a - W .. a - 1``) followed by the chunk's own keys, ``W + w`` keys held only for that
   forward (a chunk of any width fits: "what a chunk being prefilled needs" is transient); then the
   chunk's last ``min(w, W)`` keys go into the ring.  A chunk from position 0 reads only its own keys.

Entries are not in position order, and some hold nothing yet (a short sequence) or a position that
left the window (a fork, below): :func:`entry_positions` says which token position each entry holds,
from where the row stands, and :func:`mask` hides by token position what the query may not see
(attention over keys is order-free; the mask, not the order, carries the positions).

Forks: a copy of a ring is good at ``length`` while the positions the next query needs,
``length - W + 1 .. length - 1``, are still held, i.e. the source has run at most one position past
``length`` (or has not yet wrapped its ring).  A fork further back is refused (:func:`holds`) and the
core computes that prefix again: with prefix caching, a prompt sharing only part of a cached prompt
longer than the window is a cache miss; a prompt extending a whole cached prompt, an identical prompt,
``n > 1`` and beam search fork where the ring stands and always hit.
"""

from __future__ import annotations

import torch


def entry_positions(last: torch.Tensor, size: int, ring: int) -> torch.Tensor:
    """``[rows, size]``: the token position entry ``j`` of each row holds when the row's last written
    position is ``last[r]`` (-1: nothing written); negative where an entry holds nothing.

    Entry ``j`` holds the latest position ``p <= last`` with ``p % ring == j``.  ``size`` is the ring
    buffer's length: ``ring`` once the context reached it, less before (then every position written
    is below ``size`` and entry ``j`` is position ``j``)."""
    j = torch.arange(size, device=last.device)
    return last[:, None] - torch.remainder(last[:, None] - j[None, :], ring)


def same_block(queries: torch.Tensor, keys: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[rows, width, n]``: the query at ``queries[r, i]`` and the key at ``keys[r, j]`` (token
    positions; negative: an empty ring entry) lie in one image block."""
    def block(p: torch.Tensor) -> torch.Tensor:
        inside = (p >= 0) & (p < len(blocks))
        return torch.where(inside, blocks[p.clamp(0, len(blocks) - 1)], -1)

    q, k = block(queries)[:, :, None], block(keys)[:, None, :]
    return (q == k) & (q >= 0)


def mask(queries: torch.Tensor, keys: torch.Tensor, window: int, dtype: torch.dtype, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, 1, width, n]`` additive: a query at ``queries[r, i]`` sees the key at token position
    ``keys[r, j]`` when ``q - window < k <= q``, or ``k > q - window`` in the query's image block of
    ``blocks`` (a negative key position is an empty entry)."""
    q = queries[:, :, None]
    k = keys[:, None, :]
    seen = k <= q if blocks is None else (k <= q) | same_block(queries, keys, blocks)
    allowed = (k >= 0) & seen & (k > q - window)
    out = torch.zeros(allowed.shape, dtype=dtype, device=queries.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


class Keys:
    """A ring layer's keys in one forward (every layer of that window and ring length shares it): the
    queries' and keys' token positions, and the mask, built once per dtype.  ``keys`` None: every
    query sees every key (full rings at decode) or the keys are the queries' own (plain causal)."""

    def __init__(self, window: int, queries: torch.Tensor, keys: torch.Tensor | None) -> None:
        self.window, self.queries, self.keys = window, queries, keys
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def mask(self, dtype: torch.dtype, blocks: torch.Tensor | None = None) -> torch.Tensor | None:
        """``blocks``: the forward's image blocks (its queries see their block's later keys)."""
        if blocks is not None:  # the keys of a chunk from position 0 are its queries
            keys = self.keys if self.keys is not None else self.queries
            return mask(self.queries, keys, self.window, dtype, blocks)
        if self.keys is None:
            return None
        if dtype not in self._masks:
            self._masks[dtype] = mask(self.queries, self.keys, self.window, dtype)
        return self._masks[dtype]


def holds(src_length: int, length: int, window: int, ring: int) -> bool:
    """A copy of a ring that stands at ``src_length`` serves a sequence of ``length`` positions: the
    positions its next query needs (from ``length - window + 1``) are among those held (from
    ``src_length - ring``)."""
    return length <= src_length and max(0, length - window + 1) >= max(0, src_length - ring)
