"""The LoRA adapters a step engine keeps loaded: least recently used first out, one lock for the
submitting threads (``prepare_lora``) and the engine thread (each forward), and a forward's rows
grouped by adapter.  lmdock-hf and lmdock-mlx share it; each says how one adapter loads (``load``)
and what a forward does with the groups (its own low-rank add).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from lmdock._llm.lora import LoRARequest

#: Adapters kept loaded when ``build.max_loras`` is not set.
DEFAULT_MAX_LORAS = 8

A = TypeVar("A")


class AdapterCache(Generic[A]):
    """Loaded adapters by ``LoRARequest.key``, at most ``max_loras`` past a step's own.

    A subclass implements :meth:`load` (read or check one adapter; raise ``RequestError`` naming what
    is wrong).  An evicted adapter loads again when a request names it.  ``bool(cache)`` says whether
    any adapter is loaded: a forward with none skips the adapter work.
    """

    def __init__(self, max_loras: int | None = None, max_rank: int | None = None) -> None:
        self.max_loras = max_loras or DEFAULT_MAX_LORAS
        #: ``build.max_lora_rank``: the largest rank ``load`` admits (None: any)
        self.max_rank = max_rank
        self.loaded: OrderedDict[tuple[str, str], A] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0  # adapters loaded (tests check the cache)

    def load(self, lora: LoRARequest) -> A:
        """One adapter, ready for :meth:`groups`; raises when it cannot run on this engine."""
        raise NotImplementedError(f"{type(self).__name__} must implement load")

    def __bool__(self) -> bool:
        return bool(self.loaded)

    def prepare(self, lora: LoRARequest) -> None:
        """Load the adapter unless it is loaded (any thread); raises when it cannot be."""
        self.get(lora)

    def get(self, lora: LoRARequest) -> A:
        """The adapter, loaded if it is not, and now the most recently used."""
        with self._lock:
            adapter = self.loaded.get(lora.key)
            if adapter is None:
                adapter = self.load(lora)
                self.loads += 1
                self.loaded[lora.key] = adapter
            self.loaded.move_to_end(lora.key)
            return adapter

    def groups(self, loras: Sequence[LoRARequest | None]) -> list[tuple[A, list[int] | None]]:
        """The rows of a forward (``loras[row]``: the adapter row runs under, None: the base model)
        grouped by adapter, in the order of their first row: ``(adapter, rows)``, ``rows`` None
        where every row of the forward runs under that adapter."""
        rows: dict[tuple[str, str], list[int]] = {}
        named: dict[tuple[str, str], LoRARequest] = {}
        for row, lora in enumerate(loras):
            if lora is not None:
                rows.setdefault(lora.key, []).append(row)
                named[lora.key] = lora
        return [(self.get(named[key]), None if len(group) == len(loras) else group) for key, group in rows.items()]

    def evict(self, keep: Iterable[tuple[str, str]]) -> None:
        """Past ``max_loras``, drop the least recently used adapters but those in ``keep`` (the keys of
        the adapters the current step runs under)."""
        if len(self.loaded) <= self.max_loras:
            return
        kept = set(keep)
        with self._lock:
            for key in [k for k in self.loaded if k not in kept][: max(0, len(self.loaded) - self.max_loras)]:
                del self.loaded[key]
