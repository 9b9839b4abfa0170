"""lmdock-hf's KV state, and the one object transformers sees of it.

KV state lives in a slot cache: per layer, one tensor ``[slots, kv_heads, length, head_dim]``, one
slot per live sequence, kept compact (a released slot is refilled by the last one), so a decode
batch of every running sequence is a zero-copy view of the first slots.  A sliding-window layer's
``length`` is its window, a ring of the last positions (``lmdock_hf._window``); a full layer's is
the longest context.

For one forward the model gets a :class:`BatchView` as its cache.  It is a subclass of
``transformers.cache_utils.Cache``, the base class transformers exports for caches of one's own, and
overrides only the methods of that base class a decoder forward calls: ``update`` (attention writes
its new keys and values and reads the rows' whole KV back), ``get_seq_length`` and
``get_mask_sizes``.  Everything else (``is_sliding``, ``offloading``, ...) is the base class's own.
Arguments past the ones lmdock uses are taken as ``*args, **kwargs`` and ignored where they carry
nothing for us: transformers 4.56 passes ``cache_kwargs`` positionally, 5.24 passes ``kwargs=``
(a duck-typed view with a fixed signature broke on that release: issue 26).  The keyword a
forward takes the cache by is read from its signature (:func:`cache_keyword`).  The step engine
and the offload engine both use this module; ``plugins/hf/tests/test_cache.py`` calls it the way
each supported transformers release does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lmdock.backend import SlotTable
from transformers.cache_utils import Cache

from lmdock_hf import _window
from lmdock_hf._attention import layer_mask
from lmdock_hf._states import Key, SlotStates


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword ``module.forward`` takes the cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class SlotKVCache(SlotTable):
    """Per layer, K and V as ``[slots, kv_heads, length, head_dim]``, grown by doubling; ``windows``
    (layer -> window, ``lmdock_hf._family.windows``): those layers' ``length`` stops at the window."""

    #: stored rows are codes that :meth:`encode` / :meth:`decode` translate (the 4-bit cache); the
    #: plain cache stores the model's tensors as they are and skips both calls
    packed = False

    def __init__(self, device: torch.device, dtype: torch.dtype, max_len: int, windows: dict[int, int] | None = None) -> None:
        super().__init__()
        self.device, self.dtype, self.max_len = device, dtype, max_len
        #: sliding layers kept as rings of their window (``lmdock_hf._window``): layer -> window
        self.windows = dict(windows or {})
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.cap_slots = 0
        self.cap_len = 0
        #: hybrid models' conv / recurrent states, one row per slot (empty for attention-only models)
        self.states = SlotStates()

    def reserve(self, slots: int, length: int) -> None:
        """Grow (by doubling) so ``slots`` slots of ``length`` positions fit."""
        new_slots, new_len = self.cap_slots, self.cap_len
        while new_slots < slots:
            new_slots = self._more_slots(new_slots, slots)
        while new_len < length:
            new_len = min(self.max_len, max(64, new_len * 2))
        if (new_slots, new_len) == (self.cap_slots, self.cap_len):
            return
        if self.states and new_slots != self.cap_slots:
            self.states.resize(new_slots, len(self))
        for layer in range(len(self.k)):
            self.k[layer] = self._grown(self.k[layer], new_slots, self.layer_len(layer, new_len))
            self.v[layer] = self._grown(self.v[layer], new_slots, self.layer_len(layer, new_len))
        self.cap_slots, self.cap_len = new_slots, new_len

    def layer_len(self, layer: int, cap_len: int | None = None) -> int:
        """Positions a slot holds in ``layer``: the context's, or at most the window for a sliding
        layer.  A ring below its window holds every position so far at its own index (no position
        has wrapped yet), so growing it to the window keeps it valid."""
        cap_len = self.cap_len if cap_len is None else cap_len
        window = self.windows.get(layer)
        return min(cap_len, window) if window else cap_len

    def _more_slots(self, have: int, need: int) -> int:
        return max(4, have * 2)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    def _grown(self, t: torch.Tensor, slots: int, length: int) -> torch.Tensor:
        out = self._zeros((slots, t.shape[1], length, t.shape[3]), t.dtype, t.device)
        out[: t.shape[0], :, : t.shape[2]] = t
        return out

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.k) <= idx:  # allocated at the first write: heads and dims come from the model
            shape = (self.cap_slots, like.shape[1], self.layer_len(len(self.k)), like.shape[3])
            self.k.append(self._zeros(shape, like.dtype, like.device))
            self.v.append(self._zeros(shape, like.dtype, like.device))
        return self.k[idx], self.v[idx]

    def release(self, seq_id: int) -> None:
        move = super().release(seq_id)
        if move is not None:  # keep slots compact: the last sequence's KV moves into the hole
            hole, last = move
            for k, v in zip(self.k, self.v):
                k[hole].copy_(k[last])
                v[hole].copy_(v[last])
            self.states.move(hole, last)
        else:
            self.states.drop(len(self))
        self._shrink()

    def _shrink(self) -> None:
        """Give a burst's slots back: once a quarter of them or fewer are in use, halve them until more
        are (the slots are compact, so the live ones are the first; the gap between growing at full
        and shrinking at a quarter keeps a steady load from reallocating).  Without it, one request
        with ``n`` = 512 kept 512 slots of KV for the life of the process (issue 28)."""
        slots, used = self.cap_slots, len(self)
        while slots > 4 and used * 4 <= slots:
            slots //= 2
        if slots == self.cap_slots:
            return
        self.states.resize(slots, len(self))
        for layer in range(len(self.k)):
            self.k[layer] = self._kept(self.k[layer], slots)
            self.v[layer] = self._kept(self.v[layer], slots)
        self.cap_slots = slots

    def _kept(self, t: torch.Tensor, slots: int) -> torch.Tensor:
        out = self._zeros((slots, *t.shape[1:]), t.dtype, t.device)
        out[: len(self)] = t[: len(self)]
        return out

    def copy(self, src: int, dst: int, length: int) -> None:
        """``dst`` gets ``src``'s first ``length`` positions (a ring whole: see :meth:`holds`)."""
        s, d = self.slot_of[src], self.slot(dst)
        self.reserve(len(self), length)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            n = k.shape[2] if layer in self.windows else length
            k[d, :, :n] = k[s, :, :n]
            v[d, :, :n] = v[s, :, :n]
        self.states.copy(s, d)
        self.states.lengths[d] = length

    def truncate(self, seq_id: int, length: int) -> bool:
        """Cut a sequence back to ``length`` positions.  Attention KV needs nothing: a row reads keys
        up to its own position only (the engine's mask), and the next chunk, at ``length``,
        overwrites the stale ones.  A recurrent state has folded the dropped positions in, and a sliding
        layer's ring has written them over positions its window still needs: False."""
        if self.states or self.windows or seq_id not in self.slot_of:
            return False
        return length >= 0

    def state_length(self, seq_id: int) -> int:
        """The positions the sequence has written: where its recurrent state and rings stand (neither
        can be cut back to fewer: ``_states``, ``_window``)."""
        return self.states.lengths.get(self.slot_of[seq_id], 0)

    def holds(self, seq_id: int, length: int) -> bool:
        """Every sliding layer of the sequence still holds the window a copy at ``length`` needs."""
        src = self.state_length(seq_id)
        return all(_window.holds(src, length, w, w) for w in set(self.windows.values()))

    def nbytes(self) -> int:
        """Bytes of KV (and recurrent) state allocated, every slot (what the slots take in memory)."""
        return sum(t.nbytes for t in self.k + self.v) + sum(t.nbytes for t in self.states.t.values())

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The model's ``[..., head_dim]`` keys or values as stored rows (only where ``packed``)."""
        return x

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows back as the model's tensors (only where ``packed``)."""
        return rows


class BatchView(Cache):
    """What the model sees as its cache (``past_key_values``) for one forward over some slots.

    Row ``r`` of the forward is slot ``slots[r]``, its new tokens at positions ``starts[r] ..
    starts[r] + width - 1``; attention reads each row's keys up to ``kv_len`` (the engine's mask
    hides what a row may not see), or a sliding layer's ring (``lmdock_hf._window``) with the mask
    of its entries' token positions, which ``update`` hands to the layer's attention call.
    """

    # a view lives for one forward over Python-side slot bookkeeping: nothing here can be compiled
    is_compileable = False

    def __init__(self, cache: SlotKVCache, slots: list[int], starts: list[int], width: int, kv_len: int) -> None:
        super().__init__(layers=[])  # the layers' state is the slot cache's, not the base class's
        self.cache = cache
        self.starts = starts
        self.width = width
        self.kv_len = kv_len
        dev = cache.device
        self.contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self.slots = slots
        self.slot_t = torch.tensor(slots, device=dev)
        self.start_t = torch.tensor(starts, device=dev)
        #: recurrent state the rows read (a decode row continues its state; a prefill from 0 starts one)
        self.prior = any(starts)
        self._gathered: dict[Key, torch.Tensor] = {}  # state rows copied out of non-contiguous slots
        self._ring_keys: dict[tuple[int, int], _window.Keys] = {}  # (window, ring length) -> its layers' keys
        states = cache.states
        for s, a in zip(slots, starts):
            states.lengths[s] = a + width
        if states and self.prior and not all(starts):  # a fresh row in a decode batch starts from zeros
            fresh = torch.tensor([s for s, a in zip(slots, starts) if a == 0], device=dev)
            for t in states.t.values():
                t[fresh] = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's new K/V for ``layer_idx``; return every row's K/V up to ``kv_len``.

        ``*args, **kwargs``: what the calling transformers release adds (``cache_kwargs`` with the
        cache position, or ``kwargs=``); the slot positions come from ``starts``, so none is needed.
        """
        cache = self.cache
        if not cache.packed:
            return self._write(key_states, value_states, layer_idx)
        # FlexLLMGen attends to the token being generated at the cache's precision too, so a position
        # reads the same whether this forward, an earlier chunk or the prefix cache wrote it
        k, v = self._write(cache.encode(key_states), cache.encode(value_states), layer_idx)
        return cache.decode(k, key_states.dtype), cache.decode(v, value_states.dtype)

    def _write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        K, V = self.cache.layer(layer_idx, key)
        window = self.cache.windows.get(layer_idx)
        if window:
            return self._write_ring(K, V, key, value, window)
        layer_mask(None)  # a full layer: the engine's mask
        if self.width == 1:
            K[self.slot_t, :, self.start_t] = key[:, :, 0]
            V[self.slot_t, :, self.start_t] = value[:, :, 0]
        else:  # prefill rows of one width (the offload engine batches them; the step engine runs one at a time)
            w = self.width
            for r, (s, a) in enumerate(zip(self.slots, self.starts)):
                K[s, :, a : a + w] = key[r]
                V[s, :, a : a + w] = value[r]
        if self.contiguous:
            lo, hi = self.slots[0], self.slots[0] + len(self.slots)
            return K[lo:hi, :, : self.kv_len], V[lo:hi, :, : self.kv_len]
        return K[self.slot_t, :, : self.kv_len], V[self.slot_t, :, : self.kv_len]

    def _rows_of(self, t: torch.Tensor) -> torch.Tensor:
        """The forward's rows of a slot tensor: a view where the slots are contiguous, else a copy."""
        if self.contiguous:
            return t[self.slots[0] : self.slots[0] + len(self.slots)]
        return t[self.slot_t]

    def _write_ring(self, K: torch.Tensor, V: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer (``lmdock_hf._window``): decode writes, then reads the ring; a prefill
        chunk reads the ring as it stood and its own keys, then keeps its last ``window`` keys."""
        if self.width == 1:
            at = torch.remainder(self.start_t, window)
            K[self.slot_t, :, at] = key[:, :, 0]
            V[self.slot_t, :, at] = value[:, :, 0]
            keys, values = self._rows_of(K), self._rows_of(V)
        elif self.prior:  # torch.cat copies the ring before the chunk overwrites it below
            keys, values = torch.cat([self._rows_of(K), key], dim=2), torch.cat([self._rows_of(V), value], dim=2)
        else:
            keys, values = key, value
        if self.width > 1:
            kept = min(self.width, window)
            for r, (s, a) in enumerate(zip(self.slots, self.starts)):
                at = torch.remainder(torch.arange(a + self.width - kept, a + self.width, device=key.device), window)
                K[s][:, at] = key[r, :, -kept:]
                V[s][:, at] = value[r, :, -kept:]
        layer_mask(self._ring(window, K.shape[2]))
        return keys, values

    def _ring(self, window: int, size: int) -> _window.Keys:
        """The token positions of a ring layer's keys in this forward, once per window and ring length."""
        if (window, size) not in self._ring_keys:
            queries = self.start_t[:, None] + torch.arange(self.width, device=self.start_t.device)[None, :]
            if self.width == 1:  # full rings at decode: every entry in the window
                full = size == window and min(self.starts) >= window - 1
                keys = None if full else _window.entry_positions(self.start_t, size, window)
            elif self.prior:  # the ring as it stood before the chunk, then the chunk
                keys = torch.cat([_window.entry_positions(self.start_t - 1, size, window), queries], dim=1)
            else:  # a chunk from position 0: causal, and windowed once it is wider than the window
                keys = None if self.width <= window else queries
            self._ring_keys[(window, size)] = _window.Keys(window, queries, keys)
        return self._ring_keys[(window, size)]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Positions already cached before this forward (of the longest row)."""
        return self.kv_len - self.width

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for transformers' mask builders: every row reads ``kv_len`` keys
        from position 0.  (4.56 passes the cache positions, 5.x the query length; neither changes it.)"""
        return self.kv_len, 0

    # -- hybrid models: conv / recurrent states (transformers 5's linear-attention Cache API) ----------

    def _rows(self, key: Key) -> torch.Tensor | None:
        t = self.cache.states.t.get(key)
        if t is None or not self.prior:
            return None  # a prefill from position 0: the model starts the state
        if self.contiguous:
            return t[self.slots[0] : self.slots[0] + len(self.slots)]  # a view: in-place updates land
        rows = t[self.slot_t]  # a copy: written back by finish() unless the model stores new rows
        self._gathered[key] = rows
        return rows

    def _store(self, key: Key, rows: torch.Tensor) -> torch.Tensor:
        t = self.cache.states.get(key, rows, self.cache.cap_slots)
        self._gathered.pop(key, None)
        if self.contiguous:
            lo = self.slots[0]
            t[lo : lo + len(self.slots)] = rows
            return t[lo : lo + len(self.slots)]
        t[self.slot_t] = rows
        return rows

    def finish(self) -> None:
        """After the forward: state rows the model updated in place in a copy go back to their slots."""
        for key, rows in self._gathered.items():
            self.cache.states.t[key][self.slot_t] = rows
        self._gathered.clear()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._rows((layer_idx, "conv", state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._rows((layer_idx, "recurrent", state_idx))

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.prior

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # nothing is ever cropped: a fork copies whole states (``_states``)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """As ``LinearAttentionLayer.update_conv_state``: return the inputs the causal convolution
        reads (the kept state, then the new ones), keep the last ``kernel`` of them."""
        key = (layer_idx, "conv", state_idx)
        prev = self._rows(key)
        if prev is not None:
            full = torch.cat([prev, conv_states], dim=-1)
            kernel = prev.shape[-1]
        else:
            known = self.cache.states.t.get(key)
            kernel = conv_kernel_size or (known.shape[-1] if known is not None else conv_states.shape[-1])
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0))
        self._store(key, full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self._store((layer_idx, "recurrent", state_idx), recurrent_states)
