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

    def __len__(self) -> int:
        """Sequences whose KV state the cache holds."""
        return len(self._kv)

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


class _PNode:
    __slots__ = ("children", "holders")

    def __init__(self) -> None:
        self.children: dict[int, _PNode] = {}
        self.holders: set[int] = set()  # cached sequences whose prompt passes through this node


class PromptCache:
    """Automatic prefix caching for generate requests: a trie over the prompts of recent requests,
    each cached prompt's KV state held by an engine sequence forked from it.  A new prompt forks the
    KV state of the longest prefix it shares with any cached prompt and computes only the rest.
    Bounded; least recently used go first; every entry is dropped when the scheduler has to preempt.

    Each LoRA adapter has a trie of its own (``adapter``: ``LoRARequest.key``, None for the base
    model): KV state computed under one adapter is never reused under another."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self.roots: dict[Any, _PNode] = {}
        self._entries: OrderedDict[int, tuple[Any, tuple[int, ...]]] = OrderedDict()  # seq_id -> (adapter, prompt), LRU first
        self.hit_tokens = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """KV positions the cached prompts hold (counted apart, even where an engine shares them)."""
        return sum(len(t) for _, t in self._entries.values())

    def lookup(self, tokens: Sequence[int], adapter: Any = None, whole: bool = False) -> tuple[int | None, int]:
        """``(a cached sequence sharing the longest prefix with tokens under the same adapter, that
        prefix's length)``; ``whole``: only a cached prompt that ``tokens`` extends all of."""
        self.lookups += 1
        node, best, depth = self.roots.get(adapter), None, 0
        if node is None:
            return None, 0
        for i, tok in enumerate(tokens):
            node = node.children.get(tok)  # type: ignore[assignment]
            if node is None or not node.holders:
                break
            if whole:
                ends = [h for h in node.holders if len(self._entries[h][1]) == i + 1]
                if ends:
                    best, depth = ends[0], i + 1
                continue
            best, depth = next(iter(node.holders)), i + 1
        if best is not None:
            self._entries.move_to_end(best)
        return best, depth

    def insert(self, tokens: Sequence[int], seq_id: int, adapter: Any = None) -> list[int]:
        """Cache ``seq_id`` (whose KV state covers exactly ``tokens``, computed under ``adapter``);
        return sequences to release."""
        node = self.roots.setdefault(adapter, _PNode())
        for tok in tokens:
            node = node.children.setdefault(tok, _PNode())
            node.holders.add(seq_id)
        self._entries[seq_id] = (adapter, tuple(tokens))
        evicted = []
        while len(self._entries) > self.max_entries:
            evicted.append(self._remove(next(iter(self._entries))))
        return evicted

    def _remove(self, seq_id: int) -> int:
        adapter, tokens = self._entries.pop(seq_id)
        node = self.roots[adapter]
        for tok in tokens:
            child = node.children[tok]
            child.holders.discard(seq_id)
            if not child.holders:
                del node.children[tok]
                break
            node = child
        if not self.roots[adapter].children:
            del self.roots[adapter]  # an adapter no longer in use leaves nothing behind
        return seq_id

    def evict(self, tokens: int) -> tuple[list[int], int]:
        """Drop least recently used prompts until ``tokens`` KV positions are freed (or none is left);
        return the sequences to release and the positions freed."""
        evicted, freed = [], 0
        while self._entries and freed < tokens:
            seq_id = next(iter(self._entries))
            freed += len(self._entries[seq_id][1])
            evicted.append(self._remove(seq_id))
        return evicted, freed

    def clear(self) -> list[int]:
        held = list(self._entries)
        self._entries.clear()
        self.roots = {}
        return held
