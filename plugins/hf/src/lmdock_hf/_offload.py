"""OffloadPolicy on lmdock-hf: FlexLLMGen's schedule on a transformers decoder stack.

Weights of the decoder layers that the policy does not keep resident live in lmdock's own on-disk
layout (one file per layer, each tensor at a 4 KiB-aligned offset, optionally group-wise 4-bit),
made once from the checkpoint and cached.  At each step the whole running batch passes through each
layer once (FlexLLMGen's block schedule): a thread reads layer i+1 (``O_DIRECT``, into one of two
preallocated buffers) while layer i computes over every sequence of the step.  Embeddings, norms and
the LM head stay resident; the KV cache lives on the accelerator or in RAM, group-wise 4-bit with
``compress_cache`` (:class:`CompressedSlotKVCache`).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lmdock import BackendError, ModelConfig, OffloadPolicy, UnsupportedError
from lmdock.backend import SeqChunk, StepOutput, read_model_json

from lmdock_hf._cache import BatchView, SlotKVCache, cache_keyword
from lmdock_hf._direct import DirectReader, ShortFile
from lmdock_hf._engine import (
    ATTENTION,
    HFStepEngine,
    _context_length,
    _device,
    _dtype,
    _register_attention,
)

ALIGN = 4096
LAYOUT_VERSION = 1
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_root() -> Path:
    """lmdock's cache folder (shared with lmdock-onnx's exports)."""
    root = os.environ.get("LMDOCK_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "lmdock"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# -------------------------------------------------------------------------------------------------
# group-wise 4-bit (FlexLLMGen's compress_weight / compress_cache: min-max per group, 16 levels)
# -------------------------------------------------------------------------------------------------


def compress_4bit(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (last dim divisible by ``group``) -> (packed uint8 [n, group/2], float16 [n, 2] min/scale)."""
    g = w.float().reshape(-1, group)
    lo, hi = g.min(dim=1).values, g.max(dim=1).values
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[:, None]) / scale[:, None]).round_().clamp_(0, 15).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), torch.stack([lo, scale], dim=1).to(torch.float16)


def decompress_4bit(packed: torch.Tensor, meta: torch.Tensor, out: torch.Tensor) -> None:
    """Inverse of :func:`compress_4bit`, written into ``out`` (any float dtype, same numel)."""
    n, half = packed.shape
    q = torch.empty((n, half * 2), dtype=torch.uint8, device=packed.device)
    q[:, 0::2] = packed & 15
    q[:, 1::2] = packed >> 4
    meta = meta.float()
    vals = q.to(torch.float32).mul_(meta[:, 1:2]).add_(meta[:, 0:1])
    out.view(n, half * 2).copy_(vals)


# -------------------------------------------------------------------------------------------------
# compress_cache: the KV cache group-wise 4-bit (FlexLLMGen's comp_cache_config: 4 bits, group 64,
# group_dim 2 of its [seq, batch*heads, head_dim] cache, i.e. along head_dim)
# -------------------------------------------------------------------------------------------------


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


# -------------------------------------------------------------------------------------------------
# the on-disk layout
# -------------------------------------------------------------------------------------------------


def _checkpoint_files(model: str, revision: str | None) -> tuple[Path, list[Path]]:
    folder = Path(model).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, revision=revision, allow_patterns=["*.json", "*.safetensors"]))
        except Exception as exc:  # noqa: BLE001 - any hub failure means the same to the user
            raise BackendError(f"lmdock-hf offload could not find {model!r} locally: {exc}") from exc
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return folder, [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedError(
            f"lmdock-hf offload streams weights from a safetensors checkpoint; {str(folder)!r} has none "
            "(re-save the model with save_pretrained(safe_serialization=True))"
        )
    return folder, files


class Checkpoint:
    """Tensors of a safetensors checkpoint, read one at a time (never the whole model)."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.where[name].get_tensor(name).to(dtype)


@dataclass(frozen=True)
class Entry:
    name: str  # relative to the layer, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    compressed: bool  # packed 4-bit at offset, then float16 [groups, 2] at meta_offset
    meta_offset: int = 0

    def numel(self) -> int:
        return math.prod(self.shape)


class Layout:
    """lmdock's offload layout: ``manifest.json`` and ``layer_NNN.bin`` per decoder layer."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        manifest = json.loads((folder / "manifest.json").read_text())
        self.dtype = _TORCH_DTYPES[manifest["dtype"]]
        self.group = manifest["group"]
        self.num_layers = manifest["num_layers"]
        self.entries = [Entry(e["name"], tuple(e["shape"]), e["offset"], e["nbytes"], e["compressed"], e.get("meta_offset", 0)) for e in manifest["entries"]]
        self.layer_bytes = manifest["layer_bytes"]

    def path(self, layer: int) -> Path:
        return self.folder / f"layer_{layer:03d}.bin"

    @property
    def disk_bytes(self) -> int:
        return self.layer_bytes * self.num_layers


def layout_folder(mc: ModelConfig, policy: OffloadPolicy, dtype: torch.dtype, ckpt_files: list[Path]) -> Path:
    """Where the layout of this checkpoint, dtype and compression lives (a content-ish key)."""
    stamp = [(str(f.resolve()), f.stat().st_size, int(f.stat().st_mtime)) for f in ckpt_files]
    key = json.dumps([LAYOUT_VERSION, mc.model, mc.revision, str(dtype), policy.compress_weight, policy.compress_group_size, stamp])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = Path(policy.offload_dir).expanduser() if policy.offload_dir else cache_root() / "hf-offload"
    return base / f"{Path(mc.model).name or 'model'}-{digest}"


def ensure_layout(folder: Path, ckpt: Checkpoint, prefix: str, layer_params: list[tuple[str, tuple[int, ...]]], num_layers: int, dtype: torch.dtype, compress: bool, group: int) -> Layout:
    """Write the layout once (tensor by tensor, so a model larger than RAM converts too)."""
    if (folder / "manifest.json").is_file():
        return Layout(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    offset = 0
    elem = torch.empty((), dtype=dtype).element_size()
    for name, shape in layer_params:
        numel = math.prod(shape)
        squeeze = compress and len(shape) == 2 and shape[-1] % group == 0
        if squeeze:
            nbytes = numel // 2
            meta_offset = _align(offset + nbytes)
            entries.append({"name": name, "shape": list(shape), "offset": offset, "nbytes": nbytes, "compressed": True, "meta_offset": meta_offset})
            offset = _align(meta_offset + numel // group * 4)
        else:
            entries.append({"name": name, "shape": list(shape), "offset": offset, "nbytes": numel * elem, "compressed": False})
            offset = _align(offset + numel * elem)
    layer_bytes = offset
    for i in range(num_layers):
        buf = bytearray(layer_bytes)
        for e in entries:
            t = ckpt.get(f"{prefix}{i}.{e['name']}", dtype)
            if tuple(t.shape) != tuple(e["shape"]):
                raise UnsupportedError(f"lmdock-hf offload needs decoder layers of one shape; layer {i} {e['name']} is {tuple(t.shape)}")
            if e["compressed"]:
                packed, meta = compress_4bit(t, group)
                buf[e["offset"] : e["offset"] + e["nbytes"]] = packed.numpy().tobytes()
                m = meta.numpy().tobytes()
                buf[e["meta_offset"] : e["meta_offset"] + len(m)] = m
            else:
                buf[e["offset"] : e["offset"] + e["nbytes"]] = t.contiguous().view(torch.uint8).numpy().tobytes()
        (tmp / f"layer_{i:03d}.bin").write_bytes(buf)
    manifest = {"version": LAYOUT_VERSION, "dtype": str(dtype).removeprefix("torch."), "group": group, "num_layers": num_layers, "layer_bytes": layer_bytes, "entries": entries}
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    try:
        tmp.rename(folder)
    except OSError:  # another process made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return Layout(folder)


# -------------------------------------------------------------------------------------------------
# reading: O_DIRECT into preallocated, page-aligned buffers; a thread prefetches the next layer
# -------------------------------------------------------------------------------------------------


class LayerReader:
    """Reads whole layer files with ``O_DIRECT``, several requests outstanding (:mod:`lmdock_hf._direct`;
    normal reads plus ``POSIX_FADV_DONTNEED`` where the filesystem refuses it, so the page cache never
    holds the model)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._direct = DirectReader()
        self.bytes_read = 0

    @property
    def direct(self) -> bool:
        return self._direct.direct

    def read(self, layer: int, into: mmap.mmap) -> None:
        path = str(self.layout.path(layer))
        try:
            self.bytes_read += self._direct.read(path, memoryview(into)[: self.layout.layer_bytes])
        except ShortFile as exc:
            raise BackendError(f"lmdock-hf offload: {path} is shorter than its manifest says ({exc}); delete {self.layout.folder}") from exc

    def close(self) -> None:
        self._direct.close()


class Slot:
    """One of the two layer buffers: raw bytes (host, page-aligned) and the tensors a layer computes with."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.raw = mmap.mmap(-1, max(layout.layer_bytes, ALIGN))
        self.raw_t = torch.frombuffer(self.raw, dtype=torch.uint8)
        self.layout = layout
        self.device = device
        direct = device.type == "cpu"
        self.tensors: dict[str, torch.Tensor] = {}
        for e in layout.entries:
            if direct and not e.compressed:  # compute straight from the read buffer: no copy
                self.tensors[e.name] = self.raw_t[e.offset : e.offset + e.nbytes].view(layout.dtype).view(e.shape)
            else:
                self.tensors[e.name] = torch.empty(e.shape, dtype=layout.dtype, device=device)
        self.staged = device.type != "cpu"
        self.layer = -1

    def fill_from_raw(self) -> None:
        """Decompress and/or copy to the device what the read left in ``raw``."""
        for e in self.layout.entries:
            if e.compressed:
                n = e.numel() // self.layout.group
                packed = self.raw_t[e.offset : e.offset + e.nbytes].view(n, self.layout.group // 2).to(self.device, non_blocking=False)
                meta = self.raw_t[e.meta_offset : e.meta_offset + n * 4].view(torch.float16).view(n, 2).to(self.device)
                decompress_4bit(packed, meta, self.tensors[e.name])
            elif self.staged:
                self.tensors[e.name].copy_(self.raw_t[e.offset : e.offset + e.nbytes].view(self.layout.dtype).view(e.shape))


class Streamer:
    """Hands out streamed layers in order; with ``prefetch`` a thread fills the other buffer ahead."""

    def __init__(self, layout: Layout, layers: list[int], device: torch.device, prefetch: bool) -> None:
        self.layers = layers
        self.reader = LayerReader(layout)
        self.slots = [Slot(layout, device) for _ in range(2 if prefetch else 1)]
        self.prefetch = prefetch
        self.read_seconds = 0.0
        self.wait_seconds = 0.0
        self._free: queue.Queue[Slot] = queue.Queue()
        self._ready: queue.Queue[tuple[int, Slot | BaseException]] = queue.Queue()
        self._stop = threading.Event()
        for s in self.slots:
            self._free.put(s)
        self._thread: threading.Thread | None = None
        if prefetch and layers:
            self._thread = threading.Thread(target=self._run, name="lmdock-hf-prefetch", daemon=True)
            self._thread.start()

    def _load(self, layer: int, slot: Slot) -> None:
        t0 = time.perf_counter()
        self.reader.read(layer, slot.raw)
        slot.fill_from_raw()
        slot.layer = layer
        self.read_seconds += time.perf_counter() - t0

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                for layer in self.layers:
                    slot = self._free.get()
                    if self._stop.is_set():
                        return
                    try:
                        self._load(layer, slot)
                        self._ready.put((layer, slot))
                    except BaseException as exc:  # noqa: BLE001 - handed to the computing thread
                        self._free.put(slot)
                        self._ready.put((layer, exc))

    def acquire(self, layer: int) -> Slot:
        if not self.prefetch:
            slot = self._free.get()
            try:
                self._load(layer, slot)
            except BaseException:
                self._free.put(slot)
                raise
            return slot
        t0 = time.perf_counter()
        while True:  # after a failed step the thread may be mid-cycle: skip to the layer asked for
            got, slot = self._ready.get()
            if isinstance(slot, BaseException):
                raise BackendError(f"lmdock-hf offload could not read layer {got}: {slot}") from slot
            if got == layer:
                self.wait_seconds += time.perf_counter() - t0
                return slot
            self._free.put(slot)

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        for _ in self.slots:
            self._free.put(self.slots[0])
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.reader.close()


def measure_read_bandwidth(layout: Layout, layers: int = 2) -> float:
    """Bytes per second of O_DIRECT reads of whole layer files (a few layers, once per load)."""
    reader = LayerReader(layout)
    buf = mmap.mmap(-1, max(layout.layer_bytes, ALIGN))
    t0 = time.perf_counter()
    n = min(layers, layout.num_layers)
    for i in range(n):
        reader.read(i, buf)
    reader.close()
    return n * layout.layer_bytes / max(time.perf_counter() - t0, 1e-9)


# -------------------------------------------------------------------------------------------------
# the cost model
# -------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    resident_layers: int  # the first N decoder layers stay resident (accelerator share first)
    gpu_layers: int  # of those, how many on the accelerator (0 on CPU)
    kv_on_accelerator: bool
    batch_size: int | None
    note: str

    def describe(self, num_layers: int) -> str:
        return (
            f"{self.gpu_layers} of {num_layers} decoder layers on the accelerator, "
            f"{self.resident_layers - self.gpu_layers} in RAM, {num_layers - self.resident_layers} streamed from disk; "
            f"KV cache {'on the accelerator' if self.kv_on_accelerator else 'in RAM'}; "
            f"batch {self.batch_size if self.batch_size else 'from the scheduler'}. {self.note}"
        )


def plan(policy: OffloadPolicy, *, num_layers: int, layer_bytes: int, disk_layer_bytes: int, resident_bytes: int, kv_bytes_per_token: int, seq_len: int, default_batch: int, bandwidth: float | None, accelerator: bool) -> Plan:
    """Placement and batch: from the percentages, or from ``memory_budget_gib`` when it is set.

    The budget model (FlexLLMGen's, cut down to the CPU/disk case): the budget pays for the resident
    parts (embeddings, norms, LM head), two layer buffers, and the KV cache of the batch; what is
    left keeps whole decoder layers resident, so fewer bytes stream per step.  The batch is the
    largest (up to the scheduler's ``max_num_seqs``) whose KV cache fits after the buffers; a larger
    batch amortizes each layer's read over more tokens, which is the whole point at batch 1 (a step
    costs ``streamed bytes / bandwidth`` whatever the batch).
    """
    kv = policy.kv_cache_gpu_percent >= 100.0 and accelerator
    if policy.memory_budget_gib is None:
        resident = num_layers * (policy.weights_gpu_percent + policy.weights_cpu_percent) / 100.0
        gpu = num_layers * policy.weights_gpu_percent / 100.0 if accelerator else 0
        return Plan(int(round(resident)), int(round(gpu)), kv, policy.batch_size, "placement from the policy's percentages")
    budget = int(policy.memory_budget_gib * 2**30)
    fixed = resident_bytes + 2 * layer_bytes
    if fixed > budget:
        raise UnsupportedError(
            f"memory_budget_gib={policy.memory_budget_gib:g} is below what streaming needs: "
            f"{fixed / 2**20:.0f} MiB (resident embeddings/norms/head + two layer buffers)"
        )
    want = policy.batch_size or default_batch
    per_seq = kv_bytes_per_token * seq_len
    batch = max(1, min(want, (budget - fixed) // max(per_seq, 1)))
    left = budget - fixed - batch * per_seq
    resident = int(min(num_layers, max(0, left // max(layer_bytes, 1))))
    bw = f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "not measured"
    streamed = (num_layers - resident) * disk_layer_bytes
    step = streamed / bandwidth if bandwidth else float("nan")
    note = (
        f"Chosen from memory_budget_gib={policy.memory_budget_gib:g}: read bandwidth {bw}, "
        f"{streamed / 2**20:.0f} MiB streamed per step (~{step * 1e3:.0f} ms), "
        f"KV {per_seq / 2**20:.2f} MiB per sequence of {seq_len} tokens{' (4-bit, compress_cache)' if policy.compress_cache else ''}."
    )
    return Plan(resident, resident if accelerator else 0, kv, batch, note)


# -------------------------------------------------------------------------------------------------
# the engine
# -------------------------------------------------------------------------------------------------


def _decoder(model: Any) -> tuple[Any, str]:
    inner = getattr(model, "model", None)
    needed = ("layers", "embed_tokens", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        raise UnsupportedError(
            f"lmdock-hf offload streams Llama-style decoder stacks (model.layers, embed_tokens, norm, rotary_emb, "
            f"lm_head); {type(model).__name__} is not one; remove [offload] for this model"
        )
    return inner, "model.layers."


class _Group:
    """Chunks that pass through each layer together (one forward's worth)."""

    def __init__(self, engine: OffloadStepEngine, chunks: list[SeqChunk], all_logits: bool) -> None:
        self.chunks = chunks
        self.all_logits = all_logits
        width = len(chunks[0].token_ids)
        starts = [c.start for c in chunks]
        kv_len = max(starts) + width
        dev = engine.device
        self.view = BatchView(engine.cache, [engine.cache.slot_of[c.seq_id] for c in chunks], starts, width, kv_len)
        ids = torch.tensor([list(c.token_ids) for c in chunks], device=dev)
        self.pos = self.view.start_t[:, None] + torch.arange(width, device=dev)[None, :]
        self.mask = engine._mask(self.pos, kv_len, starts, width)
        self.hidden = engine.decoder.embed_tokens(ids)
        self.pe = engine.decoder.rotary_emb(self.hidden, self.pos)


class OffloadStepEngine(HFStepEngine):
    """HFStepEngine whose decoder layers are (partly) streamed from disk, whole batch per layer."""

    #: at least this many tokens of prefill per forward, whatever the layer size (see ``prefill_tokens``)
    MIN_PREFILL_TOKENS = 256

    def __init__(self, *args: Any, streamer: Streamer | None, streamed: list[int], plan: Plan, layout: Layout | None, kv_compress: tuple[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoder, _ = _decoder(self.model)
        self.layer_cache_kw = cache_keyword(self.decoder.layers[0])
        #: ``kv_compress`` is (head_dim, group) for compress_cache: the BatchView then stores 4-bit codes
        self.cache = HostSlotKVCache(self.device, self.dtype, self.max_seq_len)
        if kv_compress is not None:
            self.cache = CompressedSlotKVCache(self.device, self.dtype, self.max_seq_len, *kv_compress)
        self.streamer = streamer
        self.streamed = set(streamed)
        self.plan = plan
        self.layout = layout
        self.layer_params: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
        for i in streamed:
            layer = self.decoder.layers[i]
            binds = []
            for e in layout.entries if layout else ():
                mod_name, _, pname = e.name.rpartition(".")
                binds.append((layer.get_submodule(mod_name) if mod_name else layer, pname, e.name))
            self.layer_params[i] = binds
        #: what the policy (or the cost model) chose, in words
        self.offload_plan = plan.describe(len(self.decoder.layers))
        #: equal-width prefill chunks pass through a layer together, up to this many tokens a forward:
        #: their activations (q/k/v/o and the MLP's gate/up/product, ~4 x intermediate + 6 x hidden
        #: values a token) stay within about half a layer buffer, the working set's biggest part
        text = self.model.config.get_text_config()
        hidden = int(text.hidden_size)
        inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
        per_token = (4 * inter + 6 * hidden) * torch.empty((), dtype=self.dtype).element_size()
        layer_bytes = sum(p.numel() * p.element_size() for p in self.decoder.layers[0].parameters())
        self.prefill_tokens = max(self.MIN_PREFILL_TOKENS, layer_bytes // 2 // per_token)
        self.scheduler_limits = {"max_num_seqs": plan.batch_size} if plan.batch_size else {}

    @classmethod
    def load_offloaded(cls, mc: ModelConfig, options: Any, build: dict[str, Any]) -> OffloadStepEngine:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        policy = mc.offload
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        device = _device(build.get("device", "auto"))
        dtype = _dtype(build.get("dtype", "auto"), device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
            config = AutoConfig.from_pretrained(mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
        except (OSError, ValueError) as exc:
            raise BackendError(f"lmdock-hf could not load {mc.model!r}: {exc}") from exc
        if dtype == "auto":
            dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or torch.float16
            dtype = _TORCH_DTYPES.get(str(dtype).removeprefix("torch."), torch.float16) if not isinstance(dtype, torch.dtype) else dtype
        attn = options.attn_implementation
        if attn == "auto":
            _register_attention()
            attn = ATTENTION
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn, trust_remote_code=mc.trust_remote_code)
        model.eval().requires_grad_(False)
        decoder, prefix = _decoder(model)
        folder, files = _checkpoint_files(mc.model, mc.revision)
        ckpt = Checkpoint(files)
        num_layers = len(decoder.layers)
        layer_params = [(n, tuple(p.shape)) for n, p in decoder.layers[0].named_parameters()]
        elem = torch.empty((), dtype=dtype).element_size()
        layer_bytes = sum(math.prod(s) for _, s in layer_params) * elem
        resident_bytes = sum(p.numel() * elem for n, p in model.named_parameters() if not n.startswith(prefix))
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        group = kv_group(head_dim, policy.compress_group_size) if policy.compress_cache else None
        kv_per_token = kv_bytes_per_token(num_layers, kv_heads, head_dim, elem, group)
        limit = _context_length(model, tokenizer)
        max_seq_len = min(build["max_seq_len"], limit) if build.get("max_seq_len") else limit

        layout = None
        need_disk = policy.memory_budget_gib is not None or policy.disk_percent > 0
        if need_disk:
            lf = layout_folder(mc, policy, dtype, files)
            layout = ensure_layout(lf, ckpt, prefix, layer_params, num_layers, dtype, policy.compress_weight, policy.compress_group_size)
        bandwidth = measure_read_bandwidth(layout) if (layout is not None and policy.memory_budget_gib is not None) else None
        chosen = plan(
            policy, num_layers=num_layers, layer_bytes=layer_bytes, disk_layer_bytes=layout.layer_bytes if layout else layer_bytes,
            resident_bytes=resident_bytes, kv_bytes_per_token=kv_per_token, seq_len=max_seq_len,
            default_batch=mc.scheduler.max_num_seqs, bandwidth=bandwidth, accelerator=device.type != "cpu",
        )
        if chosen.resident_layers < num_layers and layout is None:
            raise UnsupportedError("lmdock-hf offload: the policy streams layers but made no layout")
        cpu = torch.device("cpu")

        def put(name: str, t: torch.Tensor, where: torch.device) -> None:
            mod_name, _, pname = name.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            mod._parameters[pname] = torch.nn.Parameter(t.to(where), requires_grad=False)

        tied = False
        for name, _p in list(model.named_parameters(remove_duplicate=False)):
            if name.startswith(prefix):
                continue
            if name in ckpt:
                put(name, ckpt.get(name, dtype), device)
            elif name == "lm_head.weight":  # tied to the input embeddings
                tied = True
            else:
                raise BackendError(f"lmdock-hf offload: {name} is not in the checkpoint of {mc.model!r}")
        if tied:
            model.lm_head.weight = decoder.embed_tokens.weight
        with torch.device(device):
            decoder.rotary_emb = type(decoder.rotary_emb)(config=model.config)
        for name, buf in model.named_buffers():
            if buf.is_meta:
                raise UnsupportedError(f"lmdock-hf offload cannot rebuild buffer {name} of {type(model).__name__}")
        for i in range(chosen.resident_layers):
            where = device if i < chosen.gpu_layers or device.type == "cpu" else cpu
            for n, _s in layer_params:
                put(f"{prefix}{i}.{n}", ckpt.get(f"{prefix}{i}.{n}", dtype), where)
            if where != device:  # RAM-resident layer on an accelerator machine: copied in when it runs
                raise UnsupportedError("lmdock-hf offload: RAM-resident layers on an accelerator are not implemented; use disk for the rest")
        del ckpt
        streamed = list(range(chosen.resident_layers, num_layers))
        streamer = Streamer(layout, streamed, device, policy.prefetch) if streamed and layout else None
        kv_device = device if chosen.kv_on_accelerator or device.type == "cpu" else cpu
        if kv_device != device:
            raise UnsupportedError("lmdock-hf offload: KV cache in RAM with compute on an accelerator is not implemented; set kv_cache_gpu_percent = 100")
        engine = cls(
            model, tokenizer, device, max_seq_len, build.get("kv_max_tokens"),
            read_model_json(mc.model, "generation_config.json"),
            streamer=streamer, streamed=streamed, plan=chosen, layout=layout,
            kv_compress=(head_dim, group) if group else None,
        )
        return engine

    # -- FlexLLMGen's block schedule: every sequence of the step through layer i, then layer i+1 ----

    @torch.inference_mode()
    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        cache = self.cache
        for c in chunks:
            cache.slot(c.seq_id)
        cache.reserve(len(cache), max(c.start + len(c.token_ids) for c in chunks))
        decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1 and not c.all_logits]
        decode.sort(key=lambda i: cache.slot_of[chunks[i].seq_id])
        # Prefill chunks of one width go through each layer together too (one forward over up to
        # prefill_tokens tokens instead of one per prompt); a chunk that wants every position's
        # logits goes alone.
        by_width: dict[int, list[int]] = {}
        alone: list[list[int]] = []
        taken = set(decode)
        for i, c in enumerate(chunks):
            if i in taken:
                continue
            if c.all_logits:
                alone.append([i])
            else:
                by_width.setdefault(len(c.token_ids), []).append(i)
        prefill = []
        for width, idx in by_width.items():
            cap = max(1, self.prefill_tokens // width)
            prefill += [idx[k : k + cap] for k in range(0, len(idx), cap)]
        order: list[list[int]] = ([decode] if decode else []) + prefill + alone
        groups = [_Group(self, [chunks[i] for i in idx], chunks[idx[0]].all_logits) for idx in order]
        for li, layer in enumerate(self.decoder.layers):
            slot = None
            if li in self.streamed:
                assert self.streamer is not None
                slot = self.streamer.acquire(li)
                for mod, pname, key in self.layer_params[li]:
                    mod._parameters[pname] = slot.tensors[key]
            try:
                for g in groups:
                    out = layer(g.hidden, attention_mask=g.mask, position_ids=g.pos, use_cache=True, position_embeddings=g.pe, **{self.layer_cache_kw: g.view})
                    g.hidden = out[0] if isinstance(out, tuple) else out
            finally:
                if slot is not None:
                    self.streamer.release(slot)  # type: ignore[union-attr]
        self.forward_calls += 1
        last = np.empty((len(chunks), self.vocab_size), dtype=np.float32)
        full: dict[int, np.ndarray] = {}
        for idx, g in zip(order, groups):
            h = self.decoder.norm(g.hidden if g.all_logits else g.hidden[:, -1:])
            logits = self.model.lm_head(h).float().cpu().numpy()
            if g.all_logits:
                full[chunks[idx[0]].seq_id] = logits[0]
                last[idx[0]] = logits[0, -1]
            else:
                last[idx] = logits[:, -1]
        return StepOutput(last, full)

    def stats(self) -> dict[str, Any]:
        s = self.streamer
        return {
            "plan": self.offload_plan,
            "bytes_read": s.reader.bytes_read if s else 0,
            "read_seconds": s.read_seconds if s else 0.0,
            "wait_seconds": s.wait_seconds if s else 0.0,
            "o_direct": s.reader.direct if s else None,
        }

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        super().close()
