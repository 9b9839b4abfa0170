"""The transformers step engine.

KV state lives in a slot cache (``lmdock_hf._cache``); the model sees it through a ``BatchView``,
a ``transformers.cache_utils.Cache`` over the rows of one forward, and a 4D additive mask that lets
each row attend to its own positions only; transformers returns such a mask as it is.  Each step runs one forward for all single-token (decode) chunks and one per prefill chunk,
so no row is padded along the query axis.  LoRA adapters (``lmdock_hf._lora``) add their low-rank
updates per row, so a decode forward mixes the base model and several adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lmdock import BackendError, ConfigError, ModelConfig, RequestError
from lmdock.backend import SeqChunk, StepEngineBase, StepOutput, read_model_json

from lmdock_hf._attention import ATTENTION, positions, register, row_mask
from lmdock_hf._cache import BatchView, SlotKVCache, cache_keyword
from lmdock_hf._family import check, inspect, windows
from lmdock_hf._lora import Adapters

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: the widest chunk that shares a padded forward (speculative verify rows are a few tokens wide)
MAX_PADDED_WIDTH = 64
_register_attention = register  # the offload engine registers it too


class HFStepEngine(StepEngineBase):
    """A transformers causal LM as an lmdock step engine."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, max_seq_len: int, kv_max_tokens: int | None,
                 generation_config: dict[str, Any], lora_limits: tuple[int | None, int | None] = (None, None)) -> None:
        """``lora_limits``: ``build.max_loras`` and ``build.max_lora_rank``."""
        super().__init__(tokenizer, vocab_size=int(model.config.get_text_config().vocab_size), max_seq_len=max_seq_len,
                         eos_token_ids=_eos_ids(model, tokenizer), generation_config=generation_config, kv_capacity_tokens=kv_max_tokens)
        #: on an accelerator the CPU waits while the step runs: the core overlaps its output work
        self.overlap_host_work = device.type != "cpu"
        self.model = model
        self.device = device
        self.dtype = next(model.parameters()).dtype
        #: sliding layers whose slots hold only their window (lmdock's attention applies the window)
        self.kv_windows = windows(model.config) if model.config._attn_implementation == ATTENTION else {}
        self.cache = SlotKVCache(device, self.dtype, max_seq_len, self.kv_windows)
        #: every layer a ring (Mistral, Phi-3): no layer reads the engine's mask, so none is built
        layers = getattr(model.config.get_text_config(), "num_hidden_layers", -1)
        self.rings_only = len(self.kv_windows) == layers and not inspect(model.config).recurrent
        self.cache_kw = cache_keyword(model)
        self.forward_calls = 0
        #: LoRA adapters, each loaded by the first request that names it (``prepare_lora``)
        self.adapters: Adapters | None = Adapters(model, *lora_limits)
        #: a recurrent (SSM / conv) state cannot be cut back: forks only at the length it stands at
        self.fork_truncates = not inspect(model.config).recurrent
        #: rejected drafts can be cut out (speculative decoding): not from a recurrent state, nor from a
        #: sliding layer's ring, whose drafts overwrote positions its window still needs
        self.truncates = self.fork_truncates and not self.kv_windows
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
        engine = cls(model, tokenizer, device, max_seq_len, build.get("kv_max_tokens"), read_model_json(mc.model, "generation_config.json"),
                     lora_limits(build))
        if vlm:
            engine.vision = _vision.load(model, mc)
        return engine

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        """A prompt with images through the model's processor (``lmdock_hf._vision``)."""
        if self.vision is None:
            raise RequestError(f"the prompt has {len(data.images)} image(s), and this model has no vision encoder: "
                               "serve a vision-language model to read images, or remove them")
        return self.vision.process(text, data, add_special_tokens)

    # -- the step-engine contract (StepEngineBase: prepare_lora and max_loras from ``adapters``) -------

    # KV tensors are inference tensors: every method that touches them runs in inference mode.
    @torch.inference_mode()
    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        if self.vision is not None:  # the step's images through the tower together, before the forwards
            self.vision.encode_step(chunks)
        if self.vision is not None and self.vision.ahead is not None:  # Gemma 3: never cut an image block (``_blocks``)
            return self.vision.ahead.step(self._step, chunks, self.vocab_size, self.device)
        return self._step(chunks)

    def _step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
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
        for rows in self._wide_groups(chunks, decoded):
            c = chunks[rows[0]]
            group = _padded([chunks[i] for i in rows])
            cache.reserve(len(cache), max(g.start + len(g.token_ids) for g in group))
            logits = self._forward(group, all_logits=c.all_logits)
            if not c.all_logits:
                last[rows] = logits
                continue
            host = logits.cpu().numpy()
            for r, i in enumerate(rows):
                width = len(chunks[i].token_ids)
                last[i] = logits[r, width - 1]
                full[chunks[i].seq_id] = host[r, :width]
        if self.adapters:
            self.adapters.evict(c.lora.key for c in chunks if c.lora is not None)
        return StepOutput(last, full)

    def _wide_groups(self, chunks: Sequence[SeqChunk], decoded: set[int]) -> list[list[int]]:
        """The other chunks, one forward each, but speculative verify rows (a few tokens with all
        logits, past the prompt's start) share one forward, padded to the widest (``_padded``), on
        attention-only models (a recurrent state would take the padding in)."""
        def short(c: SeqChunk) -> bool:
            return c.all_logits and c.start > 0 and len(c.token_ids) <= MAX_PADDED_WIDTH

        verify: list[int] = []
        out: list[list[int]] = []
        widest = max((len(c.token_ids) for i, c in enumerate(chunks) if i not in decoded and short(c)), default=0)
        for i, c in enumerate(chunks):
            if i in decoded:
                continue
            if short(c) and self.truncates and c.start + widest <= self.max_seq_len:
                verify.append(i)
            else:
                out.append([i])
        return out + ([verify] if verify else [])

    def _forward(self, chunks: list[SeqChunk], all_logits: bool) -> torch.Tensor:
        """One forward over chunks of equal width; logits [rows, vocab] (or [rows, width, vocab])."""
        width = len(chunks[0].token_ids)
        starts = [c.start for c in chunks]
        kv_len = max(starts) + width
        view = BatchView(self.cache, [self.cache.slot_of[c.seq_id] for c in chunks], starts, width, kv_len)
        ids = torch.tensor([list(c.token_ids) for c in chunks], device=self.device)
        # a prompt's chunk with images: its embeddings, image features in place of image tokens
        text = {"input_ids": ids} if chunks[0].multi_modal is None else {"inputs_embeds": self.vision.embeds(chunks[0], ids)}
        pos = view.start_t[:, None] + torch.arange(width, device=self.device)[None, :]
        # the model's rotary positions: the cache positions, or Qwen2-VL's three streams (``_mrope``)
        rope = pos if self.vision is None or self.vision.mrope is None else self.vision.mrope.positions(chunks, pos)
        blocks = self._blocks(chunks[0])
        if self.adapters:  # LoRA: which rows of this forward run under which adapter
            self.adapters.select([c.lora for c in chunks])
        try:
            with positions(pos, blocks):
                out = self.model(
                    **text,
                    attention_mask=self._mask(pos, kv_len, starts, width, blocks),
                    position_ids=rope,
                    use_cache=True,
                    **{self.cache_kw: view},
                    logits_to_keep=0 if all_logits else 1,
                )
            view.finish()
        finally:
            if self.adapters:
                self.adapters.clear()
        self.forward_calls += 1
        logits = out.logits.float()
        return logits if all_logits else logits[:, -1]

    def _blocks(self, chunk: SeqChunk) -> torch.Tensor | None:
        """A Gemma 3 prompt chunk's image blocks (``lmdock_hf._blocks``), on the device; else None."""
        if chunk.multi_modal is None or "blocks" not in chunk.multi_modal.processed:
            return None
        return chunk.multi_modal.processed["blocks"].to(self.device)

    def _mask(self, pos: torch.Tensor, kv_len: int, starts: list[int], width: int, blocks: torch.Tensor | None = None) -> torch.Tensor | None:
        """The additive 4D mask; None where our attention needs none (see ``lmdock_hf._attention``)."""
        if blocks is not None:  # an image's tokens see each other both ways
            return row_mask(pos, kv_len, self.dtype, blocks=blocks)
        if self.model.config._attn_implementation == ATTENTION:
            if width == 1 and all(a + 1 == kv_len for a in starts):
                return None  # every row sees all its keys
            if width > 1 and starts == [0] * len(starts):
                return None  # plain causal
            if self.rings_only:
                return None
        return row_mask(pos, kv_len, self.dtype)

    @torch.inference_mode()
    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        if self.vision is not None and self.vision.mrope is not None:
            self.vision.mrope.release(seq_id)
        if self.vision is not None and self.vision.ahead is not None:
            self.vision.ahead.release(seq_id)

    @torch.inference_mode()
    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        if not self.fork_truncates and self.cache.state_length(src_seq_id) != length:
            return False  # the state covers more positions than asked: the core computes them instead
        if not self.cache.holds(src_seq_id, length):
            return False  # a sliding layer's ring has moved past the window ``length`` needs (``_window``)
        self.cache.copy(src_seq_id, dst_seq_id, length)
        if self.vision is not None and self.vision.mrope is not None:
            self.vision.mrope.fork(src_seq_id, dst_seq_id)
        return True

    def truncate(self, seq_id: int, length: int) -> bool:
        """Drop the sequence's positions from ``length`` on (speculative decoding's rejected drafts)."""
        return self.cache.truncate(seq_id, length)

    def num_sequences(self) -> int:
        return len(self.cache)

    def close(self) -> None:
        self.cache = SlotKVCache(self.device, self.dtype, self.max_seq_len, self.kv_windows)
        self.model = None
        self.adapters = None  # its weights go with the model


def lora_limits(build: dict[str, Any]) -> tuple[int | None, int | None]:
    """``build.max_loras`` and ``build.max_lora_rank`` (None: not set)."""
    return build.get("max_loras"), build.get("max_lora_rank")


def _padded(chunks: list[SeqChunk]) -> list[SeqChunk]:
    """Chunks of one forward at one width: a shorter one repeats its last token.  The padding's KV
    positions lie past the sequence's end, where its next chunk writes before any query of its
    reads them (a row attends to keys up to its own position), and its logits are not returned."""
    width = max(len(c.token_ids) for c in chunks)
    return [c if len(c.token_ids) == width else
            SeqChunk(c.seq_id, [*c.token_ids, *[c.token_ids[-1]] * (width - len(c.token_ids))], c.start, c.all_logits, c.argmax_next, c.lora)
            for c in chunks]


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

