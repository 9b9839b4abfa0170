"""The transformers step engine.

KV state lives in a slot cache (``lmdock_hf._cache``); the model sees it through a ``BatchView``,
a ``transformers.cache_utils.Cache`` over the rows of one forward, and a 4D additive mask that lets
each row attend to its own positions only; transformers returns such a mask as it is.  Each step runs one forward for all single-token (decode) chunks and one per prefill chunk,
so no row is padded along the query axis.  LoRA adapters (``lmdock_hf._lora``) add their low-rank
updates per row, so a decode forward mixes the base model and several adapters.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lmdock import BackendError, ConfigError, LoRARequest, ModelConfig, RequestError
from lmdock.backend import SeqChunk, StepOutput, read_model_json

from lmdock_hf._attention import ATTENTION, positions, register, row_mask
from lmdock_hf._cache import BatchView, SlotKVCache, cache_keyword
from lmdock_hf._family import check, inspect
from lmdock_hf._lora import DEFAULT_MAX_LORAS, Adapters

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_register_attention = register  # the offload engine registers it too


class HFStepEngine:
    """A transformers causal LM as an lmdock step engine."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, max_seq_len: int, kv_max_tokens: int | None, generation_config: dict[str, Any]) -> None:
        #: on an accelerator the CPU waits while the step runs: the core overlaps its output work
        self.overlap_host_work = device.type != "cpu"
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_seq_len = max_seq_len
        self.kv_capacity_tokens = kv_max_tokens
        self.generation_config = generation_config
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(device, self.dtype, max_seq_len)
        self.cache_kw = cache_keyword(model)
        self.forward_calls = 0
        #: LoRA adapters, made on the first request that names one (``prepare_lora``)
        self.adapters: Adapters | None = None
        self._adapters_made = threading.Lock()  # submitting threads race to make it: one must win
        self.lora_limits: tuple[int | None, int | None] = (None, None)  # build.max_loras, build.max_lora_rank
        #: a recurrent (SSM / conv) state cannot be cut back: forks only at the length it stands at
        self.fork_truncates = not inspect(model.config).recurrent
        #: a vision-language model's image side (``lmdock_hf._vision``), or None for a text model
        self.vision: Any = None

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def load(cls, mc: ModelConfig, options: Any, build: dict[str, Any], quantization: dict[str, Any] | None = None) -> HFStepEngine:
        """``quantization``: what ``lmdock_hf._quant.plan`` returned, or None."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        from lmdock_hf import _vision

        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        device = _device(build.get("device", "auto"))
        dtype = _dtype(build.get("dtype", "auto"), device)
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": mc.trust_remote_code, "revision": mc.revision}
        kwargs["low_cpu_mem_usage"] = options.low_cpu_mem_usage
        try:
            tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
            vlm = _vision.is_vision_config(_config(mc))
            model = _load_model(AutoModelForImageTextToText if vlm else AutoModelForCausalLM, mc.model, options.attn_implementation, kwargs)
        except (OSError, ValueError) as exc:
            raise BackendError(
                f"lmdock-hf could not load {mc.model!r}: {exc}. Pass a local folder, or a hub id that is "
                "already in the Hugging Face cache when HF_HUB_OFFLINE=1 is set."
            ) from exc
        attn = model.config._attn_implementation
        check(inspect(model.config), mc.model, "auto" if attn == ATTENTION else attn)
        if vlm:
            _vision.check_family(model.config, mc.model)
        model.to(device).eval()
        model.requires_grad_(False)
        if quantization:
            from lmdock_hf._quant import apply

            apply(model, quantization)
        limit = _context_length(model, tokenizer)
        max_seq_len = min(build["max_seq_len"], limit) if build.get("max_seq_len") else limit
        engine = cls(model, tokenizer, device, max_seq_len, build.get("kv_max_tokens"), read_model_json(mc.model, "generation_config.json"))
        engine.lora_limits = (build.get("max_loras"), build.get("max_lora_rank"))
        if vlm:
            engine.vision = _vision.load(model, mc)
        return engine

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        """A prompt with images through the model's processor (``lmdock_hf._vision``)."""
        if self.vision is None:
            raise RequestError(f"the prompt has {len(data.images)} image(s), and this model has no vision encoder: "
                               "serve a vision-language model to read images, or remove them")
        return self.vision.process(text, data, add_special_tokens)

    # -- the step-engine contract ---------------------------------------------------------------

    @property
    def max_loras(self) -> int:
        """Adapters kept loaded (``build.max_loras``, or lmdock-hf's default); reported in /metrics."""
        return self.lora_limits[0] or DEFAULT_MAX_LORAS

    def prepare_lora(self, lora: LoRARequest) -> None:
        """Load a request's adapter (in the submitting thread): one that cannot load fails its request."""
        with self._adapters_made:
            if self.adapters is None:
                self.adapters = Adapters(self.model, *self.lora_limits)
        self.adapters.prepare(lora)

    # KV tensors are inference tensors: every method that touches them runs in inference mode.
    @torch.inference_mode()
    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        cache = self.cache
        for c in chunks:
            cache.slot(c.seq_id)
        cache.reserve(len(cache), max(c.start + len(c.token_ids) for c in chunks))
        # on the model's device: the sampler (lmdock_hf._sampler) takes what it needs from there
        last = torch.empty((len(chunks), self.vocab_size), dtype=torch.float32, device=self.device)
        full: dict[int, np.ndarray] = {}
        decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1 and not c.all_logits and c.multi_modal is None]
        decode.sort(key=lambda i: cache.slot_of[chunks[i].seq_id])
        if decode:
            last[decode] = self._forward([chunks[i] for i in decode], all_logits=False)
        decoded = set(decode)
        for i, c in enumerate(chunks):
            if i in decoded:
                continue
            logits = self._forward([c], all_logits=c.all_logits)
            last[i] = logits[-1]
            if c.all_logits:
                full[c.seq_id] = logits.cpu().numpy()
        if self.adapters is not None:
            self.adapters.evict(chunks)
        return StepOutput(last, full)

    def _forward(self, chunks: list[SeqChunk], all_logits: bool) -> torch.Tensor:
        """One forward over chunks of equal width; logits [rows, vocab] (or [width, vocab])."""
        width = len(chunks[0].token_ids)
        starts = [c.start for c in chunks]
        kv_len = max(starts) + width
        view = BatchView(self.cache, [self.cache.slot_of[c.seq_id] for c in chunks], starts, width, kv_len)
        ids = torch.tensor([list(c.token_ids) for c in chunks], device=self.device)
        # a prompt's chunk with images: its embeddings, image features in place of image tokens
        text = {"input_ids": ids} if chunks[0].multi_modal is None else {"inputs_embeds": self.vision.embeds(chunks[0], ids)}
        pos = view.start_t[:, None] + torch.arange(width, device=self.device)[None, :]
        if self.adapters is not None:
            self.adapters.select([c.lora for c in chunks])
        try:
            with positions(pos):
                out = self.model(
                    **text,
                    attention_mask=self._mask(pos, kv_len, starts, width),
                    position_ids=pos,
                    use_cache=True,
                    **{self.cache_kw: view},
                    logits_to_keep=0 if all_logits else 1,
                )
            view.finish()
        finally:
            if self.adapters is not None:
                self.adapters.clear()
        self.forward_calls += 1
        logits = out.logits.float()
        return logits[0] if all_logits else logits[:, -1]

    def _mask(self, pos: torch.Tensor, kv_len: int, starts: list[int], width: int) -> torch.Tensor | None:
        """The additive 4D mask; None where our attention needs none (see ``lmdock_hf._attention``)."""
        if self.model.config._attn_implementation == ATTENTION:
            if width == 1 and all(a + 1 == kv_len for a in starts):
                return None  # every row sees all its keys
            if width > 1 and starts == [0] * len(starts):
                return None  # plain causal
        return row_mask(pos, kv_len, self.dtype)

    @torch.inference_mode()
    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)

    @torch.inference_mode()
    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        if not self.fork_truncates and self.cache.state_length(src_seq_id) != length:
            return False  # the state covers more positions than asked: the core computes them instead
        self.cache.copy(src_seq_id, dst_seq_id, length)
        return True

    def num_sequences(self) -> int:
        return len(self.cache)

    def close(self) -> None:
        self.cache = SlotKVCache(self.device, self.dtype, self.max_seq_len)
        self.model = None
        self.adapters = None  # its weights go with the model


def _load_model(auto: Any, model: str, attn: str, kwargs: dict[str, Any]) -> Any:
    if attn != "auto":
        return auto.from_pretrained(model, attn_implementation=attn, **kwargs)
    _register_attention()
    try:
        return auto.from_pretrained(model, attn_implementation=ATTENTION, **kwargs)
    except (ValueError, ImportError):  # a model that does not take pluggable attention
        return auto.from_pretrained(model, **kwargs)


def _config(mc: ModelConfig) -> Any:
    """The model's config, to pick the auto class (a vision-language model is no causal LM to transformers)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision)


def _device(name: str) -> torch.device:
    if name != "auto":
        return _named_device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _named_device(name: str) -> torch.device:
    """``build.device`` as torch's device, refused naming the key when torch has no such device here
    (torch's own errors, a RuntimeError or an AssertionError from deep in the load, name neither)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{name!r} is not a torch device: use auto, cpu, cuda, cuda:N or mps", key="build.device") from None
    available = {"cuda": torch.cuda.is_available,
                 "mps": lambda: getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()}
    if device.type in available and not available[device.type]():
        raise ConfigError(f"{name!r}: this torch has no {device.type} device here; use cpu (or auto)", key="build.device")
    return device


def _dtype(name: str, device: torch.device) -> Any:
    if name != "auto":
        return _DTYPES[name]
    # float32 on CPU (half precision is slow or missing there); the checkpoint's dtype on accelerators
    return torch.float32 if device.type == "cpu" else "auto"


def _context_length(model: Any, tokenizer: Any) -> int:
    cfg = model.config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**7 else 2048


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids += [int(v) for v in value]
    return tuple(dict.fromkeys(ids))

