"""Slot bookkeeping for step engines that keep KV state in per-slot buffers.

A step engine with batched KV buffers (``[slots, ...]`` per layer: lmdock-hf, lmdock-onnx) gives each
live sequence one slot and keeps the slots compact, so a decode batch of every running sequence is
one contiguous block.  This class says which sequence holds which slot; the engine moves the KV data.
"""

from __future__ import annotations


class SlotTable:
    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}
        self.seq_at: list[int] = []

    def __len__(self) -> int:
        return len(self.seq_at)

    def slot(self, seq_id: int) -> int:
        """The sequence's slot; a sequence not seen yet takes the next free one."""
        if seq_id not in self.slot_of:
            self.slot_of[seq_id] = len(self.seq_at)
            self.seq_at.append(seq_id)
        return self.slot_of[seq_id]

    def release(self, seq_id: int) -> tuple[int, int] | None:
        """Free the sequence's slot.  The last slot's sequence moves into the hole to keep the slots
        compact: returns ``(hole, last)``, whose KV data the engine must copy from ``last`` to ``hole``;
        None when there is nothing to move."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return None
        last = len(self.seq_at) - 1
        moved = self.seq_at.pop()
        if slot == last:
            return None
        self.seq_at[slot] = moved
        self.slot_of[moved] = slot
        return slot, last
