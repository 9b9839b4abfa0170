"""Streaming offloaded layers: ``O_DIRECT`` reads into preallocated, page-aligned buffers, and a
thread that fills the other buffer with the next layer while one computes."""

from __future__ import annotations

import mmap
import queue
import threading
import time

import torch
from lmdock import BackendError

from lmdock_hf._direct import DirectReader, ShortFile
from lmdock_hf._offload_layout import ALIGN, Layout, decompress_4bit


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
