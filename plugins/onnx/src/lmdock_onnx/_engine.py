"""An ONNX Runtime ``InferenceSession`` as an lmdock step engine.

KV state lives in preallocated NumPy buffers, per layer ``[slots, kv_heads, capacity, head_dim]``:
one slot per live sequence, kept compact (a released slot is refilled by the last one), capacity
grown by doubling.  A step passes the model the **whole** capacity of the rows it runs as their past
(a slice of contiguous slots is one contiguous block, bound to the session by pointer: no copy) and an
attention mask that lets each row see only its own positions: ``[1] * start + [0] * (capacity -
start) + [1] * new``.  Rows at different positions therefore decode in one batch, and the graph
returns only the new positions' KV, which the engine writes into the buffers.  Each step runs one
session call for all single-token (decode) chunks and one per prefill chunk.

A model with sliding-window layers gets a **contiguous** past instead: transformers' window compares
buffer indices (the query's index after the past with each key's), so a gap would widen every row's
window by its width.  Each step copies each row's positions, right-aligned, into a past as long as
the longest row's (``[0] * (longest - start) + [1] * start + [1] * new`` in the mask): buffer distance
is then token distance, and the window counts tokens.  It costs a copy of the rows' KV per step.

Folders exported elsewhere work when they follow the convention in docs/backends/onnx.md; where
their ``present`` outputs put the new positions (only the new ones, appended after the past, or at
each row's own length as ONNX Runtime's GroupQueryAttention does) is found by one probe at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lmdock import BackendError, UnsupportedError
from lmdock.backend import SeqChunk, SlotTable, StepEngineBase, StepOutput

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": None}
_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


@dataclass
class Layout:
    """How a folder's graph names and shapes its inputs and outputs."""

    past_keys: list[str]
    past_values: list[str]
    present_keys: list[str]
    present_values: list[str]
    position_ids: bool
    kv_heads: int
    head_dim: int
    dtype: Any
    vocab_size: int | None
    #: where ``present`` holds the new positions: "new" (only them), "append" (after the whole
    #: past), "row" (at each row's own length); found by ``probe``.
    present: str = "new"

    @property
    def layers(self) -> int:
        return len(self.past_keys)


def read_layout(session: Any, folder: Path, genai_decoder: dict[str, Any], hints: dict[str, int | None]) -> Layout:
    """``genai_decoder``: genai_config.json's ``model.decoder`` ({} without one); ``hints``: kv_heads
    and head_dim from the configs, for graphs whose KV shapes leave them symbolic."""
    names = _names(genai_decoder)
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    past_k, past_v, pres_k, pres_v = [], [], [], []
    while names["past_key"] % len(past_k) in inputs:
        i = len(past_k)
        past_k.append(names["past_key"] % i)
        past_v.append(names["past_value"] % i)
        pres_k.append(names["present_key"] % i)
        pres_v.append(names["present_value"] % i)
    expected = {"input_ids", "attention_mask", *past_k, *past_v}
    missing = [n for n in [*expected, *pres_k, *pres_v, "logits"] if n not in inputs and n not in outputs]
    unknown = sorted(set(inputs) - expected - {"position_ids"})
    if not past_k or missing or unknown:
        raise BackendError(
            f"{folder}: this ONNX graph does not follow lmdock-onnx's convention (docs/backends/onnx.md): "
            + (f"missing {sorted(missing)[:6]}" if missing or not past_k else "")
            + (f"; inputs lmdock does not feed: {unknown[:6]}" if unknown else "")
            + ". Export it with lmdock-onnx (point LLM at the transformers checkpoint) or rename its inputs."
        )
    shape = list(inputs[past_k[0]].shape)
    dtype = _NP.get(inputs[past_k[0]].type)
    for axis, key in ((1, "kv_heads"), (3, "head_dim")):  # symbolic in some exports: from the configs
        if not isinstance(shape[axis], int):
            shape[axis] = hints.get(key)
    if dtype is None or not all(isinstance(d, int) for d in (shape[1], shape[3])):
        raise BackendError(f"{folder}: past KV input {past_k[0]} has type {inputs[past_k[0]].type} and shape {shape}; "
                           "lmdock-onnx needs float32/float16 KV with fixed head count and head size")
    vocab = outputs["logits"].shape[-1]
    return Layout(past_k, past_v, pres_k, pres_v, "position_ids" in inputs, int(shape[1]), int(shape[3]), dtype,
                  vocab if isinstance(vocab, int) else None)


def _names(genai_decoder: dict[str, Any]) -> dict[str, str]:
    """Input/output name patterns: lmdock's (and optimum's), or those in onnxruntime-genai's config."""
    ins, outs = genai_decoder.get("inputs", {}), genai_decoder.get("outputs", {})
    return {
        "past_key": ins.get("past_key_names", "past_key_values.%d.key"),
        "past_value": ins.get("past_value_names", "past_key_values.%d.value"),
        "present_key": outs.get("present_key_names", "present.%d.key"),
        "present_value": outs.get("present_value_names", "present.%d.value"),
    }


def session_options(options: Any) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if options.intra_op_num_threads is not None:
        so.intra_op_num_threads = options.intra_op_num_threads
    if options.inter_op_num_threads is not None:
        so.inter_op_num_threads = options.inter_op_num_threads
    so.enable_mem_pattern = options.enable_mem_pattern
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[options.graph_optimization_level])
    for key, value in options.session_config.items():
        so.add_session_config_entry(key, str(value))
    return so


def providers(device: str, option: tuple[str, ...]) -> list[str]:
    import onnxruntime as ort

    have = ort.get_available_providers()
    if option:
        wanted = list(option)
    elif device in ("auto", "cpu"):
        wanted = ["CPUExecutionProvider"]
    elif device.startswith("cuda"):
        wanted = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        raise UnsupportedError(f"build.device {device!r}: lmdock-onnx maps 'cpu' and 'cuda'; name other execution providers in "
                               "[models.NAME.backends.onnx] providers = [...]")
    absent = [p for p in wanted if p not in have]
    if absent:
        raise UnsupportedError(f"execution provider(s) {absent} are not in this onnxruntime build (it has {have}); "
                               "install the onnxruntime package for that hardware (onnxruntime-gpu for CUDA)")
    return wanted


class SlotCache(SlotTable):
    """Per-layer K and V buffers ``[slots, kv_heads, capacity, head_dim]``; slots kept compact."""

    def __init__(self, layout: Layout, max_len: int) -> None:
        super().__init__()
        self.layout = layout
        self.max_len = max_len
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.cap_slots = 0
        self.cap_len = 0
        self.generation = 0  # bumped whenever the buffers are reallocated

    def reserve(self, slots: int, length: int) -> None:
        """Grow so ``slots`` slots of ``length`` positions fit; the only reallocation.

        Slots double.  Length grows by a quarter, in multiples of 64: graphs that attend over the
        whole capacity (lmdock's own exports) pay for its unused part at every step, so it stays
        close to the longest sequence; each growth copies the cache once.
        """
        new_slots, new_len = self.cap_slots, self.cap_len
        while new_slots < slots:
            new_slots = max(4, new_slots * 2)
        if new_len < length:
            new_len = min(self.max_len, -(-max(length, new_len * 5 // 4) // 64) * 64)
        if (new_slots, new_len) == (self.cap_slots, self.cap_len):
            return
        shape = (new_slots, self.layout.kv_heads, new_len, self.layout.head_dim)
        for buffers in (self.k, self.v):
            for layer in range(self.layout.layers):
                grown = np.zeros(shape, dtype=self.layout.dtype)
                if layer < len(buffers):
                    old = buffers[layer]
                    grown[: old.shape[0], :, : old.shape[2]] = old
                    buffers[layer] = grown
                else:
                    buffers.append(grown)
        self.cap_slots, self.cap_len = new_slots, new_len
        self.generation += 1

    def buffers(self) -> list[np.ndarray]:
        """K and V of every layer, in the graph's order: layer 0 key, layer 0 value, layer 1 key..."""
        return [b for pair in zip(self.k, self.v) for b in pair]

    def release(self, seq_id: int) -> None:
        move = super().release(seq_id)
        if move is not None:  # keep slots compact: the last sequence's KV moves into the hole
            hole, last = move
            for buf in self.buffers():
                buf[hole] = buf[last]

    def copy(self, src: int, dst: int, length: int) -> None:
        s, d = self.slot_of[src], self.slot(dst)
        self.reserve(len(self), length)
        for buf in (*self.k, *self.v):
            buf[d, :, :length] = buf[s, :, :length]


class OnnxStepEngine(StepEngineBase):
    """An exported causal LM on an ONNX Runtime session."""

    #: ``truncate`` cuts rejected speculative drafts (see the method; it answers False where it cannot)
    truncates = True

    def __init__(self, session: Any, layout: Layout, tokenizer: Any, *, eos: tuple[int, ...], max_seq_len: int,
                 vocab_size: int, generation_config: dict[str, Any], kv_max_tokens: int | None, folder: Path,
                 contiguous_past: bool = False) -> None:
        super().__init__(tokenizer, vocab_size=vocab_size, max_seq_len=max_seq_len, eos_token_ids=eos,
                         generation_config=generation_config, kv_capacity_tokens=kv_max_tokens)
        #: on an accelerator the CPU waits while ONNX Runtime runs: the core overlaps its output work
        self.overlap_host_work = session.get_providers()[0] != "CPUExecutionProvider"
        self.session = session
        self.layout = layout
        self.folder = folder
        #: pass each row's past right-aligned, without a gap (sliding windows; see the module's docstring)
        self.contiguous_past = contiguous_past and layout.present != "row"
        self.cache = SlotCache(layout, max_seq_len)
        self.session_runs = 0
        self._past_names = [n for pair in zip(layout.past_keys, layout.past_values) for n in pair]
        self._present_names = [n for pair in zip(layout.present_keys, layout.present_values) for n in pair]
        self._io = session.io_binding()
        self._bound: tuple[Any, ...] | None = None
        self._kv: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        self._io_bufs: tuple[np.ndarray, np.ndarray] = (np.empty(0), np.empty(0))

    # -- the step-engine contract ---------------------------------------------------------------

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        cache = self.cache
        for c in chunks:
            cache.slot(c.seq_id)
        cache.reserve(len(cache), max(c.start + len(c.token_ids) for c in chunks))
        last = np.empty((len(chunks), self.vocab_size), dtype=np.float32)
        full: dict[int, np.ndarray] = {}
        decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1 and not c.all_logits and c.start > 0]
        if decode:
            decode.sort(key=lambda i: cache.slot_of[chunks[i].seq_id])
            last[decode] = self._run([chunks[i] for i in decode])[:, -1]
        decoded = set(decode)
        for i, c in enumerate(chunks):
            if i in decoded:
                continue
            logits = self._run([c])[0]
            last[i] = logits[-1]
            if c.all_logits:
                full[c.seq_id] = np.array(logits, dtype=np.float32)  # _run's buffer is reused
        return StepOutput(last, full)

    def _run(self, chunks: list[SeqChunk]) -> np.ndarray:
        """One session call over chunks of equal width; returns logits [rows, width, vocab] in a
        buffer that the next call with the same binding overwrites."""
        lay, cache = self.layout, self.cache
        rows, width = len(chunks), len(chunks[0].token_ids)
        slots = [cache.slot_of[c.seq_id] for c in chunks]
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        # "row" graphs (GroupQueryAttention) write the new KV in place when past and present are one
        # buffer, as onnxruntime-genai runs them: the mask then spans only the longest row.
        shared = lay.present == "row"
        fresh = rows == 1 and chunks[0].start == 0 and not shared  # a first chunk needs no past at all
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + rows))
        io = self._io
        # KV bindings stay in place while the rows, the capacity and the buffers do: a steady decode
        # batch rebinds only its token ids, mask and logits at each step.
        key = ("fresh", width) if fresh else (lo, rows, width, cache.generation) if contiguous and not self.contiguous_past else None
        if key is None or key != self._bound:
            if fresh:
                past = [np.zeros((1, lay.kv_heads, 0, lay.head_dim), dtype=lay.dtype)] * (2 * lay.layers)
            elif self.contiguous_past:
                past = self._aligned_past(slots, starts)
            elif contiguous:  # a view of whole slots: contiguous memory, bound without a copy
                past = [buf[lo : lo + rows] for buf in cache.buffers()]
            else:
                index = np.array(slots)
                past = [buf[index] for buf in cache.buffers()]
            if shared:
                present = past
            else:
                present_len = width if lay.present == "new" else past[0].shape[2] + width
                present = [np.empty((rows, lay.kv_heads, present_len, lay.head_dim), dtype=lay.dtype) for _ in past]
            for name, arr in zip(self._past_names, past):
                io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            for name, arr in zip(self._present_names, present):
                io.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            # token ids and logits: buffers of their own for as long as this binding lasts, bound once
            ids_buf = np.empty((rows, width), dtype=np.int64)
            logits_buf = np.empty((rows, width, self.vocab_size), dtype=lay.dtype)
            io.bind_input("input_ids", "cpu", 0, ids_buf.dtype, list(ids_buf.shape), ids_buf.ctypes.data)
            io.bind_output("logits", "cpu", 0, logits_buf.dtype, list(logits_buf.shape), logits_buf.ctypes.data)
            self._bound, self._kv, self._io_bufs = key, (past, present), (ids_buf, logits_buf)  # referenced while bound
        past, present = self._kv
        ids_buf, logits = self._io_bufs
        if width == 1:
            ids_buf[:, 0] = [c.token_ids[0] for c in chunks]
        else:
            ids_buf[:] = [list(c.token_ids) for c in chunks]
        seen = int(starts.max()) if shared else past[0].shape[2]  # mask positions before the new tokens
        mask = np.ones((rows, seen + width), dtype=np.int64)
        if self.contiguous_past and not fresh:  # right-aligned: each row's past ends where its new tokens start
            mask[:, :seen] = np.arange(seen)[None, :] >= seen - starts[:, None]
        else:
            mask[:, :seen] = np.arange(seen)[None, :] < starts[:, None]
        feed = {"attention_mask": mask}
        if lay.position_ids:
            feed["position_ids"] = starts[:, None] + np.arange(width)[None, :]
        for name, arr in feed.items():  # by pointer: each array stays referenced until the run ends
            io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        try:
            self.session.run_with_iobinding(io)
        except Exception as exc:  # onnxruntime's own error types: reported as the backend's
            raise BackendError(f"onnxruntime failed on a step of {rows} row(s) x {width} token(s): {exc}") from exc
        self.session_runs += 1
        if not (shared and contiguous):
            self._store(slots, starts, width, present)
        return logits

    def _aligned_past(self, slots: list[int], starts: np.ndarray) -> list[np.ndarray]:
        """Each row's positions right-aligned in a past as long as the longest row's (a copy)."""
        lay, longest = self.layout, int(starts.max())
        past = []
        for buf in self.cache.buffers():
            arr = np.zeros((len(slots), lay.kv_heads, longest, lay.head_dim), dtype=lay.dtype)
            for r, (slot, start) in enumerate(zip(slots, starts)):
                arr[r, :, longest - start :] = buf[slot, :, :start]
            past.append(arr)
        return past

    def _store(self, slots: list[int], starts: np.ndarray, width: int, present: list[np.ndarray]) -> None:
        """Write the new positions' KV into the buffers."""
        lay = self.layout
        if lay.present == "new":
            new = present
        elif lay.present == "append":
            new = [p[:, :, p.shape[2] - width :] for p in present]
        else:  # "row": row r's new positions sit at its own length (a gathered copy of the rows)
            new = [np.stack([p[r, :, a : a + width] for r, a in enumerate(starts)]) for p in present]
        if width == 1:
            slot_index = np.array(slots)
            for buf, n in zip(self.cache.buffers(), new):
                buf[slot_index, :, starts] = n[:, :, 0]
        else:
            s, a = slots[0], int(starts[0])
            for buf, n in zip(self.cache.buffers(), new):
                buf[s, :, a : a + width] = n[0]

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        self.cache.copy(src_seq_id, dst_seq_id, length)
        return True

    def truncate(self, seq_id: int, length: int) -> bool:
        """Drop positions ``length``.. of a sequence (speculative decoding's rejected tokens).  The
        buffers hold positions by index and every step's mask shows a row only ``[:start]`` of its
        past, so the next chunk at ``start = length`` writes over them and nothing else reads them:
        there is nothing to move."""
        if seq_id not in self.cache.slot_of:
            raise BackendError(f"truncate: sequence {seq_id} holds no KV state")
        return True

    def num_sequences(self) -> int:
        return len(self.cache)

    def close(self) -> None:
        self.cache = SlotCache(self.layout, self.max_seq_len)
        self._bound, self._kv, self._io_bufs = None, ([], []), (np.empty(0), np.empty(0))
        self._io = self.session = None

    # -- loading --------------------------------------------------------------------------------

    def probe(self) -> None:
        """Find where the graph's ``present`` outputs put the new positions (see ``Layout.present``)."""
        lay = self.layout
        if lay.present_keys[0] not in {o.name for o in self.session.get_outputs()}:
            return
        feed = {"input_ids": np.array([[1]], dtype=np.int64), "attention_mask": np.array([[1, 0, 1]], dtype=np.int64)}
        if lay.position_ids:
            feed["position_ids"] = np.array([[1]], dtype=np.int64)
        zeros = np.zeros((1, lay.kv_heads, 2, lay.head_dim), dtype=lay.dtype)
        feed |= {n: zeros for n in (*lay.past_keys, *lay.past_values)}
        key = self.session.run([lay.present_keys[0]], feed)[0]
        if key.shape[2] == 1:
            lay.present = "new"
        elif np.abs(key[0, :, 2]).max() > 0 and not np.abs(key[0, :, 1]).max() > 0:
            lay.present = "append"
        elif np.abs(key[0, :, 1]).max() > 0:
            lay.present = "row"
        else:
            raise BackendError(f"{self.folder}: could not tell where the graph's {lay.present_keys[0]} puts new positions")
