"""Recurrent state per slot: the conv and SSM (recurrent) states of hybrid models' linear layers.

Mamba-2 style mixers (Falcon-H1, Bamba, Granite 4 hybrids), LFM2's short convolutions and Qwen3-Next's
gated delta rule keep, per layer, a fixed-size state instead of KV positions: the last few inputs
of a causal convolution (``conv``) and a recurrent state (``recurrent``).  Here each such state is
one tensor ``[slots, ...]`` beside the KV slots, made at the first write (its shape comes from the
model), and moved, shrunk and copied with them.  A state summarises every position before it and
cannot be cut back to an earlier length: :meth:`SlotStates.length` is where each slot's state
stands, and a fork of fewer positions than that is refused (``HFStepEngine.fork``).
"""

from __future__ import annotations

import torch

#: (layer, "conv" | "recurrent", state index)
Key = tuple[int, str, int]


class SlotStates:
    def __init__(self) -> None:
        self.t: dict[Key, torch.Tensor] = {}
        #: the positions each slot's state covers (slot -> length)
        self.lengths: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.t)

    def get(self, key: Key, like: torch.Tensor, slots: int) -> torch.Tensor:
        """The state tensor of ``key``, made like ``like`` (one row's shape) at its first write."""
        if key not in self.t:
            self.t[key] = torch.zeros((slots, *like.shape[1:]), dtype=like.dtype, device=like.device)
        return self.t[key]

    def resize(self, slots: int, live: int) -> None:
        for key, t in self.t.items():
            if t.shape[0] != slots:
                out = torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
                n = min(live, slots, t.shape[0])
                out[:n] = t[:n]
                self.t[key] = out

    def move(self, hole: int, last: int) -> None:
        self.copy(last, hole)
        self.lengths[hole] = self.lengths.pop(last, 0)

    def copy(self, src: int, dst: int) -> None:
        for t in self.t.values():
            t[dst].copy_(t[src])
        self.lengths[dst] = self.lengths.get(src, 0)

    def drop(self, slot: int) -> None:
        self.lengths.pop(slot, None)
