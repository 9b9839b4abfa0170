"""Multimodal rotary positions (Qwen2-VL's and Qwen2.5-VL's mrope) over lmdock-hf's slot cache.

Qwen2-VL (and Qwen2.5-VL, the same for images) rotates queries and keys by three position streams (time, height, width).  A text token
has the same position in all three; an image's tokens take their grid row and column (from the
position where the image starts), and the text after an image continues from the largest position
so far plus one.  So past the first image a token's position is not its index in the sequence:
it is its index plus a per-sequence offset (``delta``, negative: an image of ``h x w`` tokens
advances the positions by ``max(h, w)``, not ``h * w``).

The model's own ``get_rope_index`` computes the prompt's positions when the request is submitted
(:func:`prompt_positions`); at each forward, :class:`MRope` gives every row its three streams: the
prompt's own for prompt tokens of a request with images, index plus the sequence's delta for the
rest (generated tokens, text-only requests: delta 0).  The KV cache keeps keys already rotated,
so a prefix-cache hit or a fork carries the positions with the state; the delta travels with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: families whose text side takes 3-D multimodal rotary positions
FAMILIES = {"qwen2_vl", "qwen2_5_vl"}


def prompt_positions(model: Any, ids: torch.Tensor, processed: dict[str, Any], token_types: torch.Tensor) -> None:
    """Put the prompt's ``[3, length]`` positions (``mrope``) and its delta (``mrope_delta``) in
    ``processed``, from the model's ``get_rope_index`` over the processor's outputs."""
    pos, delta = model.model.get_rope_index(ids[None], token_types[None], image_grid_thw=processed.get("image_grid_thw"))
    processed["mrope"] = pos[:, 0]
    processed["mrope_delta"] = int(delta.flatten()[0])


class MRope:
    """Each live sequence's delta, and the position ids of a forward's rows."""

    def __init__(self) -> None:
        self.deltas: dict[int, int] = {}

    def positions(self, chunks: Sequence[Any], pos: torch.Tensor) -> torch.Tensor:
        """``[3, rows, width]`` position ids for the rows of one forward, whose cache positions are ``pos``."""
        for c in chunks:
            if c.multi_modal is not None:
                self.deltas[c.seq_id] = c.multi_modal.processed["mrope_delta"]
        delta = torch.tensor([self.deltas.get(c.seq_id, 0) for c in chunks], device=pos.device)
        out = (pos + delta[:, None])[None].expand(3, -1, -1).clone()
        for row, c in enumerate(chunks):
            prompt = c.multi_modal.processed["mrope"] if c.multi_modal is not None else None
            if prompt is None:
                continue
            # a chunk may run past the prompt (a preempted sequence recomputed): those rows keep index + delta
            n = min(pos.shape[1], prompt.shape[1] - c.start)
            out[:, row, :n] = prompt[:, c.start : c.start + n].to(out.device)
        return out

    def fork(self, src: int, dst: int) -> None:
        if src in self.deltas:
            self.deltas[dst] = self.deltas[src]
        else:
            self.deltas.pop(dst, None)

    def release(self, seq_id: int) -> None:
        self.deltas.pop(seq_id, None)
