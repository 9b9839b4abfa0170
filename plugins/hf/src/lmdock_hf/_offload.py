"""OffloadPolicy on lmdock-hf: FlexLLMGen's schedule on a transformers decoder stack.

Weights of the decoder layers that the policy does not keep resident live in lmdock's own on-disk
layout (one file per layer, each tensor at a 4 KiB-aligned offset, optionally group-wise 4-bit),
made once from the checkpoint and cached.  At each step the whole running batch passes through each
layer once (FlexLLMGen's block schedule): a thread reads layer i+1 (``O_DIRECT``, into one of two
preallocated buffers) while layer i computes over every sequence of the step.  Embeddings, norms and
the LM head stay resident; the KV cache lives on the accelerator or in RAM, group-wise 4-bit with
``compress_cache`` (:class:`CompressedSlotKVCache`).

This module is the engine; beside it ``_offload_layout`` (the on-disk layout, 4-bit weights),
``_offload_reader`` (reading and prefetching layers), ``_offload_kv`` (the KV cache) and
``_offload_plan`` (the cost model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import SeqChunk, StepOutput, read_model_json

from lmdock_hf._cache import BatchView, cache_keyword
from lmdock_hf._engine import (
    ATTENTION,
    HFStepEngine,
    _context_length,
    _device,
    _dtype,
    _register_attention,
    lora_limits,
)
from lmdock_hf._family import inspect
from lmdock_hf._offload_kv import CompressedSlotKVCache, HostSlotKVCache, kv_bytes_per_token, kv_group
from lmdock_hf._offload_layout import TORCH_DTYPES, Checkpoint, Layout, checkpoint_files, ensure_layout, layout_folder
from lmdock_hf._offload_plan import Plan, plan
from lmdock_hf._offload_reader import Streamer, measure_read_bandwidth


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
        if getattr(config, "vision_config", None) is not None:
            raise UnsupportedError(f"{mc.model!r} is a vision-language model; [offload] streams a causal decoder stack only: "
                                   "remove [offload] for it (docs/vision.md)")
        if dtype == "auto":
            dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or torch.float16
            dtype = TORCH_DTYPES.get(str(dtype).removeprefix("torch."), torch.float16) if not isinstance(dtype, torch.dtype) else dtype
        family = inspect(config)
        if family.windowed or family.recurrent:
            what = "sliding-window attention layers" if family.windowed else "recurrent (SSM / conv) layers"
            raise UnsupportedError(f"lmdock-hf offload streams plain causal decoder stacks; {mc.model!r} ({family.name}) has {what}: remove [offload] for this model")
        attn = options.attn_implementation
        if attn == "auto":
            _register_attention()
            attn = ATTENTION
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn, trust_remote_code=mc.trust_remote_code)
        model.eval().requires_grad_(False)
        decoder, prefix = _decoder(model)
        folder, files = checkpoint_files(mc.model, mc.revision)
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
            kv_compress=(head_dim, group) if group else None, lora_limits=lora_limits(build),
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
                    if self.adapters:  # LoRA: which rows of this group run under which adapter
                        self.adapters.select([c.lora for c in g.chunks])
                    out = layer(g.hidden, attention_mask=g.mask, position_ids=g.pos, use_cache=True, position_embeddings=g.pe, **{self.layer_cache_kw: g.view})
                    g.hidden = out[0] if isinstance(out, tuple) else out
            finally:
                if self.adapters:
                    self.adapters.clear()
                if slot is not None:
                    self.streamer.release(slot)  # type: ignore[union-attr]
        self.forward_calls += 1
        if self.adapters:
            self.adapters.evict(c.lora.key for c in chunks if c.lora is not None)
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
