"""The offload engine's KV cache: slots in anonymous mappings, and ``compress_cache``, K and V
group-wise 4-bit (FlexLLMGen's comp_cache_config: 4 bits, group 64, group_dim 2 of its
[seq, batch*heads, head_dim] cache, i.e. along head_dim)."""

from __future__ import annotations

import math
import mmap

import torch
from lmdock import BackendError, UnsupportedError

from lmdock_hf._cache import SlotKVCache


def kv_group(head_dim: int, group: int) -> int:
    """The quantization group of ``compress_cache``, along head_dim: ``group`` (the policy's
    ``compress_group_size``, 64) when it divides head_dim; head_dim itself when head_dim is smaller
    (FlexLLMGen pads such a head to 64 values instead, which would store more than it saves); else
    the largest even divisor of head_dim below ``group``."""
    if head_dim % 2:
        raise UnsupportedError(f"lmdock-hf offload: compress_cache packs two 4-bit values per byte and needs an even head_dim, got {head_dim}")
    if head_dim <= group:
        return head_dim
    return max(d for d in range(2, group + 1, 2) if head_dim % d == 0)


def kv_row_bytes(head_dim: int, group: int) -> int:
    """Bytes of one (position, KV head) of K or V when compressed: head_dim/2 code bytes, then a
    float16 (min, scale) pair per group."""
    return head_dim // 2 + head_dim // group * 4


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, elem: int, group: int | None) -> int:
    """KV cache bytes per token of one sequence: full precision (``elem`` bytes a value), or 4-bit
    codes plus group scales when ``group`` is given (``compress_cache``)."""
    per_head = kv_row_bytes(head_dim, group) if group else head_dim * elem
    return 2 * num_layers * kv_heads * per_head


class HostSlotKVCache(SlotKVCache):
    """The slot cache as the offload engine keeps it, where memory is the scarce thing.

    Slots grow by an eighth (to a multiple of 8) rather than doubling, so 66 live sequences take
    72 slots, not 128.  On the CPU each layer's K and V are anonymous mappings of their own (as the
    layer buffers are) rather than malloc'ed: glibc serves a tensor of a few MiB from its heap once
    its mmap threshold has risen, and the tensors a growth frees then stay resident as free heap
    (measured: 93 MiB left behind after the slots grew 4 -> 128 in one generate of 64 prompts).  A
    mapping goes back to the system when its tensor is freed.
    """

    def _more_slots(self, have: int, need: int) -> int:
        return max(8, -(-max(need, have + have // 8) // 8) * 8)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return super()._zeros(shape, dtype, device)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        raw = mmap.mmap(-1, nbytes)  # zero-filled by the kernel, page by page as it is touched
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


class CompressedSlotKVCache(HostSlotKVCache):
    """The slot cache with K and V group-wise 4-bit.

    Per layer, K and V are each one uint8 tensor ``[slots, kv_heads, length, row]`` whose last axis
    holds one head at one position: ``head_dim / 2`` bytes of codes (two 4-bit values a byte, even
    index in the low nibble), then ``head_dim / group`` float16 pairs (min, scale), as bytes.  Codes
    and scales of a position live in one row, so the base class's growing, slot compaction on
    release and ``copy`` (prefix caching, beam forks) move both without knowing the format.
    """

    packed = True

    def __init__(self, device: torch.device, dtype: torch.dtype, max_len: int, head_dim: int, group: int) -> None:
        super().__init__(device, dtype, max_len)
        self.head_dim, self.group = head_dim, group
        self.row_bytes = kv_row_bytes(head_dim, group)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., head_dim]`` float -> ``[..., row_bytes]`` uint8 (min-max per group, 16 levels)."""
        if x.shape[-1] != self.head_dim:
            raise BackendError(f"lmdock-hf offload: compress_cache was set up for head_dim {self.head_dim}, the model gave {x.shape[-1]}")
        g = x.float().unflatten(-1, (-1, self.group))
        lo = g.amin(-1)
        lo16 = lo.to(torch.float16)
        scale16 = ((g.amax(-1) - lo) / 15).to(torch.float16)
        # quantize against the float16 min/scale that dequantization will use, not the float32 ones
        scale = scale16.float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
        q = ((g - lo16.float()[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).flatten(-2)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
        meta = torch.stack([lo16, scale16], dim=-1).flatten(-2).contiguous().view(torch.uint8)
        return torch.cat([codes, meta], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``[..., row_bytes]`` uint8 -> ``[..., head_dim]`` of ``dtype``."""
        half = self.head_dim // 2
        codes = rows[..., :half]
        meta = rows[..., half:].contiguous().view(torch.float16).float().unflatten(-1, (-1, 2))
        q = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
        vals = q.float().unflatten(-1, (-1, self.group)).mul_(meta[..., 1:2]).add_(meta[..., 0:1])
        return vals.flatten(-2).to(dtype)
