"""A Llama forward pass in plain NumPy, as an lmdock step engine.

Float32 throughout.  Each sequence keeps its own KV cache (one array per layer for keys and one for
values, ``[kv_heads, capacity, head_dim]``, grown by doubling).  ``step`` runs the chunks one after
another: the reference engine favours plainness over speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import SeqChunk, StepEngineBase, StepOutput, read_model_json


class Tokenizer:
    """The lmdock tokenizer contract over a ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg = read_model_json(str(folder), "tokenizer_config.json")
        self.chat_template = cfg.get("chat_template")
        self.bos_token = cfg.get("bos_token") if isinstance(cfg.get("bos_token"), str) else "<s>"
        self.eos_token = cfg.get("eos_token") if isinstance(cfg.get("eos_token"), str) else "</s>"
        self.bos_token_id = self._tok.token_to_id(self.bos_token)
        self.eos_token_id = self._tok.token_to_id(self.eos_token)

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (as transformers names it): structured output reads its vocabulary."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict[str, Any]], chat_template: str | None = None, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any) -> str:
        import jinja2

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass one")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        return env.from_string(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
        )


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * weight


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class _Cache:
    """One sequence's keys and values: per layer ``[kv_heads, capacity, head_dim]``."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.k = [np.zeros((kv_heads, 16, head_dim), np.float32) for _ in range(layers)]
        self.v = [np.zeros((kv_heads, 16, head_dim), np.float32) for _ in range(layers)]
        self.length = 0

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
        end = start + k.shape[1]
        while end > self.k[layer].shape[1]:
            self.k[layer] = np.concatenate([self.k[layer], np.zeros_like(self.k[layer])], axis=1)
            self.v[layer] = np.concatenate([self.v[layer], np.zeros_like(self.v[layer])], axis=1)
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def copy(self, length: int) -> _Cache:
        other = _Cache(0, 0, 0)
        other.k = [k.copy() for k in self.k]
        other.v = [v.copy() for v in self.v]
        other.length = length
        return other


class NumpyLlama(StepEngineBase):
    """The reference step engine.  ``StepEngineBase`` holds the contract's fields (``tokenizer``,
    ``vocab_size``, ``max_seq_len``, ``eos_token_ids``, ``generation_config``, ``kv_capacity_tokens``)
    and the optional members' defaults: no LoRA (``prepare_lora`` refuses), no ``truncate``, forks at
    any length, no ``thread_exit``.  An engine overrides what it does differently."""

    #: ``truncate`` cuts rejected speculative drafts (see the method; it answers False where it cannot)
    truncates = True

    def __init__(self, folder: Path, config: dict[str, Any], weights: dict[str, np.ndarray], tokenizer: Tokenizer) -> None:
        self.w = weights
        self.n_layers = config["num_hidden_layers"]
        self.n_heads = config["num_attention_heads"]
        self.n_kv = config.get("num_key_value_heads", self.n_heads)
        self.hidden = config["hidden_size"]
        self.head_dim = config.get("head_dim") or self.hidden // self.n_heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise BackendError(f"lmdock-template does only default RoPE, not {rope['rope_type']!r}")
        self.inv_freq = 1.0 / (theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        eos = config.get("eos_token_id")
        gen = read_model_json(str(folder), "generation_config.json")
        ids = [e for e in (gen.get("eos_token_id"), eos, tokenizer.eos_token_id) for e in (e if isinstance(e, list) else [e]) if isinstance(e, int)]
        super().__init__(tokenizer, vocab_size=config["vocab_size"], max_seq_len=config.get("max_position_embeddings", 2048),
                         eos_token_ids=tuple(dict.fromkeys(ids)), generation_config=gen)
        self.caches: dict[int, _Cache] = {}

    @classmethod
    def load(cls, mc: ModelConfig) -> NumpyLlama:
        from safetensors.numpy import load_file

        folder = Path(mc.model)
        if not (folder / "config.json").is_file():
            raise BackendError(f"lmdock-template loads local folders with config.json and model.safetensors; {mc.model!r} is not one")
        config = read_model_json(mc.model, "config.json")
        if config.get("model_type") != "llama":
            raise UnsupportedError(f"lmdock-template runs Llama models, not {config.get('model_type')!r}; use backend = 'hf'")
        weights = {k: v.astype(np.float32) for k, v in load_file(str(folder / "model.safetensors")).items()}
        engine = cls(folder, config, weights, Tokenizer(Path(mc.tokenizer or folder)))
        if mc.build.max_seq_len:  # the portable limits: context and the KV budget the scheduler keeps to
            engine.max_seq_len = min(engine.max_seq_len, mc.build.max_seq_len)
        engine.kv_capacity_tokens = mc.kv_cache.max_tokens
        return engine

    # -- the step-engine contract ---------------------------------------------------------------

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        last = np.empty((len(chunks), self.vocab_size), dtype=np.float32)
        full: dict[int, np.ndarray] = {}
        for i, c in enumerate(chunks):
            logits = self._forward(c)
            last[i] = logits[-1]
            if c.all_logits:
                full[c.seq_id] = logits
        return StepOutput(last, full)

    def release(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        self.caches[dst_seq_id] = self.caches[src_seq_id].copy(length)
        return True

    def truncate(self, seq_id: int, length: int) -> bool:
        """Drop positions ``length``.. of a sequence (speculative decoding's rejected tokens): the
        next chunk writes over them, and attention reads only ``[:start + n]``, so the length is all
        there is to cut back."""
        cache = self.caches.get(seq_id)
        if cache is None:
            raise BackendError(f"truncate: sequence {seq_id} holds no KV state")
        cache.length = min(cache.length, length)
        return True

    def num_sequences(self) -> int:
        return len(self.caches)

    def close(self) -> None:
        self.caches.clear()

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, chunk: SeqChunk) -> np.ndarray:
        cache = self.caches.setdefault(chunk.seq_id, _Cache(self.n_layers, self.n_kv, self.head_dim))
        ids = np.asarray(chunk.token_ids)
        n, start = len(ids), chunk.start
        pos = np.arange(start, start + n)
        freqs = np.outer(pos, self.inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
        x = self.w["model.embed_tokens.weight"][ids]
        for layer in range(self.n_layers):
            x = x + self._attention(layer, _rms_norm(x, self.w[f"model.layers.{layer}.input_layernorm.weight"], self.eps), cache, start, cos, sin)
            x = x + self._mlp(layer, _rms_norm(x, self.w[f"model.layers.{layer}.post_attention_layernorm.weight"], self.eps))
        cache.length = start + n
        x = _rms_norm(x, self.w["model.norm.weight"], self.eps)
        return (x @ self.lm_head.T).astype(np.float32)

    def _attention(self, layer: int, x: np.ndarray, cache: _Cache, start: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        p = f"model.layers.{layer}.self_attn."
        n, hd = x.shape[0], self.head_dim
        q = (x @ self.w[p + "q_proj.weight"].T).reshape(n, self.n_heads, hd).transpose(1, 0, 2)
        k = (x @ self.w[p + "k_proj.weight"].T).reshape(n, self.n_kv, hd).transpose(1, 0, 2)
        v = (x @ self.w[p + "v_proj.weight"].T).reshape(n, self.n_kv, hd).transpose(1, 0, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.append(layer, k, v, start)
        group = self.n_heads // self.n_kv
        keys, values = np.repeat(keys, group, axis=0), np.repeat(values, group, axis=0)
        scores = q @ keys.transpose(0, 2, 1) / np.sqrt(hd)  # [heads, n, start + n]
        causal = np.arange(keys.shape[1])[None, :] > (start + np.arange(n))[:, None]
        scores = np.where(causal[None], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        out = (scores @ values).transpose(1, 0, 2).reshape(n, self.n_heads * hd)
        return out @ self.w[p + "o_proj.weight"].T

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"model.layers.{layer}.mlp."
        gate = _silu(x @ self.w[p + "gate_proj.weight"].T)
        return (gate * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T
