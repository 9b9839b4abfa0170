"""Gemma 3's bidirectional image blocks over lmdock-hf's slot cache.

At prefill Gemma 3 lets an image's tokens attend to each other both ways: a query in an image block
also sees that block's later keys (transformers' ``blockwise_overlay``; a sliding layer's window
still applies), and everything else is causal.  :func:`prompt_blocks` numbers each prompt position's
block at submission; the forward of a prefill chunk carries them to the attention masks
(``lmdock_hf._attention.positions``).

A block's keys must all be in the forward its queries run in, so a prefill chunk that would end
inside an image block cannot be run as it is (the core picks chunk sizes from its token budget,
not knowing images).  :class:`Ahead` runs such a chunk on to the block's end with the prompt's own
ids (which the processor made at submission), and later chunks skip what was run ahead; positions
move forward only, so sliding-window rings stay as they would be.  The logits the core reads stay
exact: a chunk's last row is read only when it ends the prompt (a chunk run ahead keeps the row at
the block's end for the chunk that ends there), and prompt logprobs keep the rows run ahead until
their chunk comes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from lmdock.backend import SeqChunk, StepOutput

#: families whose images attend bidirectionally within each image's tokens at prefill
FAMILIES = {"gemma3"}


def prompt_blocks(ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``[length]``: each position's image block (0, 1, ... per run of image tokens), -1 outside
    (transformers' ``get_block_sequence_ids_for_mask``)."""
    image = ids == image_token_id
    begins = image & ~torch.cat([torch.zeros(1, dtype=torch.bool), image[:-1]])
    return torch.where(image, torch.cumsum(begins.int(), 0) - 1, -1)


def block_end(blocks: torch.Tensor, end: int) -> int:
    """Where the prompt may be cut at ``end`` without cutting an image block: ``end``, or the end
    of the block that ``end`` would fall inside."""
    if end >= len(blocks) or int(blocks[end - 1]) < 0 or int(blocks[end]) != int(blocks[end - 1]):
        return end
    inside = blocks[end:] == blocks[end - 1]
    return end + int(inside.int().argmin()) if not bool(inside.all()) else len(blocks)


@dataclass
class _Ran:
    """A sequence's positions run ahead of the core: ``begin .. end - 1``; the logits row at
    ``end - 1``; the full rows from ``begin`` where prompt logprobs are asked."""

    begin: int
    end: int
    last: torch.Tensor
    full: np.ndarray | None


class Ahead:
    """The engine's step, with chunks that would cut an image block run on to its end."""

    def __init__(self) -> None:
        self.ran: dict[int, _Ran] = {}

    def step(self, run: Callable[[list[SeqChunk]], StepOutput], chunks: Sequence[SeqChunk], vocab: int, device: torch.device) -> StepOutput:
        """``run``: the engine's own step; ``chunks``: the core's."""
        plan = [self._chunk(c) for c in chunks]
        todo = [p for p in plan if p is not None]
        out = run(todo) if todo else StepOutput(torch.empty((0, vocab), device=device))
        if all(p is c for c, p in zip(chunks, plan)):
            return out
        rows: list[torch.Tensor] = []
        full: dict[int, np.ndarray] = {}
        j = 0
        for c, p in zip(chunks, plan):
            row, done = (out.last[j], out.full.get(c.seq_id)) if p is not None else (None, None)
            j += p is not None
            r, f = self._answer(c, p, row, done)
            rows.append(r if r is not None else torch.zeros(vocab, dtype=torch.float32, device=device))
            if f is not None:
                full[c.seq_id] = f
        return StepOutput(torch.stack(rows), full)

    def _chunk(self, c: SeqChunk) -> SeqChunk | None:
        """What to run for ``c``: None where all of it ran ahead; else from where the sequence stands
        to ``c``'s end, or on to the end of the image block ``c`` would cut."""
        processed = c.multi_modal.processed if c.multi_modal is not None else {}
        ran = self.ran.get(c.seq_id)
        if ran is not None and ran.end <= c.start:
            del self.ran[c.seq_id]  # consumed (or the sequence started over)
            ran = None
        end = c.start + len(c.token_ids)
        begin = ran.end if ran is not None else c.start
        if begin >= end:
            return None
        if "blocks" not in processed:
            return c
        stop = block_end(processed["blocks"], end)
        ids = [*c.token_ids[begin - c.start :], *processed["ids"][end:stop]]
        return SeqChunk(c.seq_id, ids, begin, c.all_logits, c.argmax_next, c.lora, c.multi_modal)

    def _answer(self, c: SeqChunk, p: SeqChunk | None, row: torch.Tensor | None,
                done: np.ndarray | None) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """``c``'s last logits row (None: zeros; never read) and full rows, from what ran now (``p``)
        and what ran ahead."""
        end = c.start + len(c.token_ids)
        ran = self.ran.get(c.seq_id)
        parts: list[np.ndarray] = []
        if ran is not None and ran.full is not None and c.all_logits:
            parts.append(ran.full[c.start - ran.begin : min(end, ran.end) - ran.begin])
        if p is not None and done is not None:
            parts.append(done[: end - p.start])
        if p is not None and p.start + len(p.token_ids) > end:  # ran ahead: keep the rest for later chunks
            stop = p.start + len(p.token_ids)
            self.ran[c.seq_id] = _Ran(end, stop, row, done[end - p.start :] if done is not None else None)  # type: ignore[arg-type]
            row = None  # c's own last row: not the end of the prompt, so never read
        elif p is None and ran is not None and ran.end == end:
            row = ran.last
        return row, (np.concatenate(parts) if parts else None) if c.all_logits else None

    def release(self, seq_id: int) -> None:
        self.ran.pop(seq_id, None)
