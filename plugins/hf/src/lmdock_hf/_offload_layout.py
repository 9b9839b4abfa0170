"""lmdock's on-disk layout for offloaded decoder layers: one file per layer, each tensor at a 4 KiB-
aligned offset (so it reads with ``O_DIRECT`` straight into a buffer the layer computes from),
optionally group-wise 4-bit (FlexLLMGen's ``compress_weight``); made once from a safetensors
checkpoint, tensor by tensor, and cached."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lmdock import BackendError, ModelConfig, OffloadPolicy, UnsupportedError

ALIGN = 4096
LAYOUT_VERSION = 1
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
# the on-disk layout
# -------------------------------------------------------------------------------------------------


def checkpoint_files(model: str, revision: str | None) -> tuple[Path, list[Path]]:
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
        self.dtype = TORCH_DTYPES[manifest["dtype"]]
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
