"""genlm-backend's ``AsyncLM`` surface over an lmdock ``LLM``, so genlm-control's code runs on any backend
that declares ``next_token_logprobs``.

genlm's models return torch tensors (``.exp()``, ``torch.topk``), so this adapter does too whenever
torch can be imported (NumPy arrays otherwise); ``LLM.next_token_logprobs`` itself stays NumPy, so
that lmdock's own API returns one type whatever is installed.  torch is imported on first use only:
``import lmdock`` never imports it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from lmdock._config.sampling import SamplingParams
from lmdock._plugin.errors import ConfigError

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _tensor(array: Any) -> Any:
    """A torch tensor of ``array`` (no copy) when torch is importable, else the array itself."""
    try:
        import torch
    except ImportError:
        return array
    return torch.from_numpy(array)


def _stack(rows: list[Any]) -> Any:
    try:
        import torch
    except ImportError:
        import numpy as np

        return np.stack(rows)
    return torch.stack(rows)


class AsyncLM:
    """genlm-backend's ``AsyncLM`` (and ``AsyncTransformer`` / ``AsyncVirtualLM``'s ``from_name``) on an
    lmdock :class:`~lmdock.LLM`: ``await lm.next_token_logprobs(ids)``, ``sample``, ``batch_sample``,
    ``byte_vocab``, ``str_vocab``, ``clear_cache``, ``clear_kv_cache``, ``cache_kv``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self._vocab: tuple[list[bytes], list[str]] | None = None

    @classmethod
    def from_name(cls, model_name: str, engine_opts: dict[str, Any] | None = None, **llm_options: Any) -> AsyncLM:
        """Load ``model_name`` (a config-file name, a path or a hub id) with ``LLM(model_name, **engine_opts,
        **llm_options)``: vLLM's engine arguments in ``engine_opts`` go through lmdock's alias table."""
        from lmdock._llm.facade import LLM

        return cls(LLM(model_name, **{**(engine_opts or {}), **llm_options}))

    # -- vocabulary ------------------------------------------------------------------------------

    @property
    def byte_vocab(self) -> list[bytes]:
        """Each token id's bytes (SentencePiece's ``▁`` as a space, ``<0x0A>`` as its byte, GPT-2's
        byte-level alphabet decoded)."""
        return self._vocabulary()[0]

    @property
    def str_vocab(self) -> list[str]:
        """Each token id's text (its bytes as UTF-8, invalid sequences replaced)."""
        return self._vocabulary()[1]

    def _vocabulary(self) -> tuple[list[bytes], list[str]]:
        if self._vocab is None:
            byte_vocab = decode_vocab(self.tokenizer)
            self._vocab = (byte_vocab, [b.decode("utf-8", errors="replace") for b in byte_vocab])
        return self._vocab

    # -- next-token logprobs ---------------------------------------------------------------------

    async def next_token_logprobs(self, token_ids: Sequence[int]) -> Any:
        """Log-probabilities of the next token, shape [vocab] (a torch tensor when torch is importable)."""
        return _tensor(await self.llm.next_token_logprobs(token_ids))

    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> Any:
        return _tensor(self.llm.next_token_logprobs_sync(token_ids))

    async def batch_next_token_logprobs(self, token_ids_list: Sequence[Sequence[int]]) -> Any:
        return _stack(list(await asyncio.gather(*[self.next_token_logprobs(ids) for ids in token_ids_list])))

    def batch_next_token_logprobs_sync(self, token_ids_list: Sequence[Sequence[int]]) -> Any:
        return _tensor(self.llm.batch_next_token_logprobs_sync(token_ids_list))

    def clear_cache(self) -> None:
        """Drop the prefix cache and the KV state it holds."""
        self.llm.clear_cache()

    def clear_kv_cache(self) -> None:
        """genlm's ``AsyncTransformer.clear_kv_cache``: lmdock keeps results and KV state in one cache."""
        self.llm.clear_cache()

    def cache_kv(self, prompt_tokens: Sequence[int]) -> None:
        """Compute and keep the KV state of ``prompt_tokens``, so later queries that extend it start there."""
        self.llm.next_token_logprobs_sync(prompt_tokens)

    # -- sampling ----------------------------------------------------------------------------------

    async def sample(self, prompt_token_ids: Sequence[int], max_tokens: int, eos_token_ids: Sequence[int],
                     temperature: float = 1.0, seed: int | None = None) -> list[int]:
        """Up to ``max_tokens`` sampled tokens, stopping before the first of ``eos_token_ids`` (not
        included), as genlm's ``sample``; drawn by lmdock's sampler in one request."""
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True,
                                stop_token_ids=tuple(eos_token_ids), detokenize=False)
        out = await self.llm.generate_async(list(prompt_token_ids), params)
        tokens = list(out.outputs[0].token_ids)
        return tokens[:-1] if tokens and tokens[-1] in eos_token_ids else tokens

    async def batch_sample(self, prompt_token_ids_list: Sequence[Sequence[int]], max_tokens: int, eos_token_ids: Sequence[int],
                           temperature: float = 1.0, seed: int | None = None) -> list[list[int]]:
        return list(await asyncio.gather(*[self.sample(ids, max_tokens, eos_token_ids, temperature, seed) for ids in prompt_token_ids_list]))


def load_model_by_name(name: str, backend: str | None = None, llm_opts: dict[str, Any] | None = None) -> AsyncLM:
    """genlm-backend's ``load_model_by_name``: ``backend`` is an lmdock backend name ("vllm", "hf", "mlx"...;
    None: lmdock's ``auto``); ``llm_opts`` go to ``LLM(...)``."""
    if backend == "mock":
        raise ConfigError("backend 'mock': genlm's MockAsyncLM has no lmdock counterpart; load a real (small) model")
    return AsyncLM.from_name(name, **({"backend": backend} if backend else {}), **(llm_opts or {}))


def decode_vocab(tokenizer: Any) -> list[bytes]:
    """The bytes of every token of a transformers tokenizer: byte tokens (``<0x0A>``), SentencePiece
    pieces (``▁`` is a space) and GPT-2's byte-level pieces."""
    if tokenizer is None:
        raise ConfigError("byte_vocab needs a tokenizer; this LLM was loaded without one")
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    byte_level = _gpt2_bytes() if any(p and "Ġ" in p for p in pieces) else None
    out = []
    for piece in pieces:
        if piece is None:
            out.append(b"")
        elif (m := _BYTE_TOKEN.match(piece)) is not None:
            out.append(bytes([int(m.group(1), 16)]))
        elif byte_level is not None:
            out.append(bytes(byte_level.get(ch, ord(ch) & 0xFF) for ch in piece))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return out


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}
