"""lmdock-hf's attention function: transformers' attention semantics over the slot cache's rows.

The engine hands every forward one additive mask that lets each row see its own positions (rows
of a decode batch sit at different positions).  transformers builds its per-layer masks (a sliding
window on some layers) from one cache position shared by all rows, so it cannot build ours; every
layer gets the engine's mask as it is, and this function adds what the layer asks for through the
keywords transformers passes the attention function:

- ``sliding_window``: the layer sees keys ``q - window < k <= q`` (transformers'
  ``sliding_window_overlay``), per layer (Gemma 2/3, gpt-oss, Qwen 2 keep full layers beside
  sliding ones; Mistral and Phi-3 pass one window for all layers);
- ``softcap`` (Gemma 2's ``attn_logit_softcapping``): scores go through ``tanh`` before the mask;
- ``s_aux`` (gpt-oss's attention sinks): a per-head logit that joins the softmax and is dropped.

A forward may also carry image blocks (Gemma 3, ``lmdock_hf._blocks``): a query in an image's tokens
also sees the later keys of that image (transformers' ``blockwise_overlay``); a window still applies.

The row positions come from :func:`positions`, which the engine enters around each forward.  A
sliding layer whose slot cache holds only its window (a ring, ``lmdock_hf._window``) reads keys that
are not at positions ``0 .. kv_len - 1``: the cache's ``update``, called by the layer just before its
attention, hands over those keys' mask (:func:`layer_mask`), and the engine's mask is not used there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lmdock import BackendError

from lmdock_hf._window import same_block

if TYPE_CHECKING:
    from lmdock_hf._window import Keys

ATTENTION = "lmdock_attention"  # no "sdpa" in the name: transformers would then refuse it for models without SDPA (Gemma 2, gpt-oss)


class _Forward(threading.local):
    """The positions of the forward running in this thread (one engine steps in one thread)."""

    pos: torch.Tensor | None = None  # [rows, width] the query positions
    masks: dict[int, torch.Tensor] | None = None  # window (0: none) -> additive mask, built once per forward
    ring: Keys | None = None  # the keys of the ring layer whose attention runs next (set by its cache update)
    blocks: torch.Tensor | None = None  # [positions] the image block of each position (-1: none), or None


_now = _Forward()


@contextmanager
def positions(pos: torch.Tensor, blocks: torch.Tensor | None = None) -> Iterator[None]:
    """Around one forward: its rows' query positions (keys are at positions 0 .. kv_len - 1), and
    the image block of each position where its images attend bidirectionally (one row then)."""
    _now.pos, _now.masks, _now.blocks = pos, {}, blocks
    try:
        yield
    finally:
        _now.pos, _now.masks, _now.blocks = None, None, None



def layer_mask(keys: Keys | None) -> None:
    """The slot cache's ``update`` for the layer whose attention runs next: its ring keys, or None
    (a full layer: the engine's mask)."""
    _now.ring = keys


def _ring_mask(query: torch.Tensor, sliding_window: int | None) -> tuple[bool, torch.Tensor | None]:
    """(True, mask) where the layer's keys are a ring's; its window must be the one the layer applies."""
    ring, _now.ring = _now.ring, None
    if ring is None:
        return False, None
    if ring.window != (sliding_window or 0):
        raise BackendError(
            f"lmdock-hf keeps this layer's KV as a sliding window of {ring.window} positions (from the model config's "
            f"layer_types / sliding_window), but the layer attends with sliding_window={sliding_window}: the model's "
            "layers do not follow its config; please report the model to lmdock"
        )
    return True, ring.mask(query.dtype, _now.blocks)


def row_mask(pos: torch.Tensor, kv_len: int, dtype: torch.dtype, window: int = 0, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, 1, width, kv_len]`` additive: row ``r``'s query at ``pos[r, i]`` sees key ``k`` when
    ``k <= pos`` or both lie in one image block of ``blocks`` (and ``k > pos - window`` for a window)."""
    keys = torch.arange(kv_len, device=pos.device)[None, None, :]
    q = pos[:, :, None]
    allowed = keys <= q
    if blocks is not None:
        allowed = allowed | same_block(pos, keys[0].expand(pos.shape[0], -1), blocks)
    if window:
        allowed &= keys > q - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def _mask_for(query: torch.Tensor, key: torch.Tensor, given: torch.Tensor | None, window: int) -> torch.Tensor | None:
    """The mask a layer needs: the engine's, or this forward's windowed one.  A window only hides
    keys once there are more keys than it covers."""
    kv_len = key.shape[2]
    if not window or kv_len <= window:
        return given
    if _now.pos is None:
        raise RuntimeError("lmdock-hf's attention ran a sliding-window layer outside an engine forward")
    masks = _now.masks
    assert masks is not None  # noqa: S101 - set together with pos
    if window not in masks:
        masks[window] = row_mask(_now.pos, kv_len, query.dtype, window, _now.blocks)
    return masks[window]


def _causal(query: torch.Tensor, key: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor | None:
    """The engine passes None for a prefill from position 0 (plain causal): materialise it for eager."""
    if given is not None or query.shape[2] == 1:
        return given
    pos = _now.pos if _now.pos is not None else torch.arange(query.shape[2], device=query.device)[None]
    return row_mask(pos, key.shape[2], query.dtype, blocks=_now.blocks)


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
              softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA that keeps grouped KV heads grouped (``enable_gqa``) even with a mask; the eager form
    where a layer soft-caps its scores or has sinks (SDPA can do neither).

    transformers' own SDPA path repeats the KV heads whenever a mask is given, which copies the
    whole KV state of every layer at every decode step; with rows at different positions we always
    pass a mask, and this is 4x faster in attention on CPU.  ``None`` means causal from position 0
    (a prefill chunk that starts the sequence) or no masking at all (one query per row).
    """
    ringed, mask = _ring_mask(query, sliding_window)
    if not ringed:
        mask = _mask_for(query, key, attention_mask, sliding_window or 0)
    if softcap or s_aux is not None:
        return _eager(query, key, value, _causal(query, key, mask), scaling, softcap, s_aux), None
    # a module that is not causal (a vision tower's encoder layers) sees all its keys
    causal = mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
           softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """transformers' eager attention of Gemma 2 (soft-capped scores) and gpt-oss (sinks), in the
    order their ``eager_attention_forward`` computes it."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask[:, :, :, : key.shape[-2]]
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        logits = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
