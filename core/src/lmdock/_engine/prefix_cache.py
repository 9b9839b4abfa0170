"""The prefix cache behind ``next_token_logprobs``: a trie over token ids (genlm-backend's design).

A node can hold a finished result (the next-token logprobs after exactly that prefix) and the id of
an engine sequence whose KV state covers exactly that prefix.  A query that hits a result runs no
forward pass; a query that extends a cached prefix forks that KV state and computes only the rest.
Results are small and kept; KV-holding sequences are bounded, least recently used go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class _Node:
    __slots__ = ("children", "seq_id", "result")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.seq_id: int | None = None
        self.result: Any = None


class PrefixCache:
    def __init__(self, max_kv_sequences: int = 32) -> None:
        self.max_kv_sequences = max_kv_sequences
        self.root = _Node()
        self._kv: OrderedDict[int, _Node] = OrderedDict()  # seq_id -> node, least recent first

    def lookup(self, tokens: Sequence[int]) -> tuple[Any, int | None, int]:
        """``(result or None, seq_id of the longest cached KV prefix or None, its length)``."""
        node, best, best_len = self.root, None, 0
        for i, tok in enumerate(tokens):
            child = node.children.get(tok)
            if child is None:
                return None, best, best_len
            node = child
            if node.seq_id is not None:
                best, best_len = node.seq_id, i + 1
        if best is not None:
            self._kv.move_to_end(best)
        return node.result, best, best_len

    def insert(self, tokens: Sequence[int], result: Any, seq_id: int | None) -> list[int]:
        """Store a result (and the sequence holding its KV state); return sequences to release."""
        node = self.root
        for tok in tokens:
            node = node.children.setdefault(tok, _Node())
        node.result = result
        evicted: list[int] = []
        if seq_id is not None:
            if node.seq_id is not None and node.seq_id != seq_id:
                evicted.append(node.seq_id)
                self._kv.pop(node.seq_id, None)
            node.seq_id = seq_id
            self._kv[seq_id] = node
            while len(self._kv) > self.max_kv_sequences:
                old, old_node = self._kv.popitem(last=False)
                old_node.seq_id = None
                evicted.append(old)
        return evicted

    def clear(self) -> list[int]:
        """Forget everything; return the sequences whose KV state must be released."""
        held = list(self._kv)
        self._kv.clear()
        self.root = _Node()
        return held
