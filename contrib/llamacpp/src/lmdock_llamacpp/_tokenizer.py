"""The GGUF's own vocabulary (llama.cpp's tokenizer) behind lmdock's Tokenizer interface.

``encode`` is ``llama_tokenize`` with special tokens parsed from the text (as a Hugging Face
tokenizer does, so a chat template's ``<s>`` becomes the BOS id); ``decode`` is ``llama_detokenize``.
Decoding returns bytes that may end inside a UTF-8 character (byte-fallback tokens): they become
U+FFFD here, which is what the core's incremental detokenizer waits on, so a stream never shows a
broken character.  Chat templates are the GGUF's ``tokenizer.chat_template``, rendered with Jinja2
the way transformers renders them.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Sequence
from typing import Any

import llama_cpp as lc


class GgufTokenizer:
    """llama.cpp's vocabulary of one loaded model (the model must outlive it)."""

    def __init__(self, model: Any, vocab: Any) -> None:
        self._vocab = vocab
        self.vocab_size = lc.llama_vocab_n_tokens(vocab)
        self.bos_token_id = _id(lc.llama_vocab_bos(vocab))
        self.eos_token_id = _id(lc.llama_vocab_eos(vocab))
        self.pad_token_id = _id(lc.llama_vocab_pad(vocab))
        self.bos_token = self._piece(self.bos_token_id)
        self.eos_token = self._piece(self.eos_token_id)
        template = lc.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None

    def __len__(self) -> int:
        return self.vocab_size

    def close(self) -> None:
        """Called by the engine as it frees the model: the vocabulary goes with it."""
        self._vocab = None

    def _live(self) -> Any:
        if self._vocab is None:
            from lmdock import EngineClosedError

            raise EngineClosedError("this model was closed (its llama.cpp vocabulary is freed); create a new LLM")
        return self._vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._live(), data, len(data), buf, cap, add_special_tokens, True)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(token_ids)
        if not ids:
            return ""
        tokens = (lc.llama_token * len(ids))(*ids)
        cap = 8 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = lc.llama_detokenize(self._live(), tokens, len(ids), buf, cap, skip_special_tokens, not skip_special_tokens)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            cap = -n

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [lc.llama_vocab_get_text(self._live(), i).decode("utf-8", errors="replace") for i in ids]

    def llguidance_tokenizer(self, n_vocab: int, eos_token_ids: list[int]) -> Any:
        """llguidance's view of this vocabulary (llguidance's own llama.cpp reader: each token's piece,
        control tokens marked special, llama.cpp's tokenizer for forced text): how the core's
        structured-output stage constrains a GGUF model, which has no Hugging Face tokenizer."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        with warnings.catch_warnings():  # it calls llama_token_get_attr, which llama-cpp-python deprecates, per token
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self._live(), n_vocab=n_vocab, eos_token=eos_token_ids or None)

    def _piece(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.decode([token_id])

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> Any:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this GGUF file holds no tokenizer.chat_template; pass chat_template=...")
        text = _render(template, conversation, add_generation_prompt=add_generation_prompt and not continue_final_message,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        if continue_final_message and conversation:
            last = str(conversation[-1].get("content", ""))
            end = text.rfind(last)
            if last and end >= 0:
                text = text[: end + len(last)]
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _render(template: str, messages: list[dict[str, Any]], **context: Any) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **context)


def _id(token: int) -> int | None:
    return None if token < 0 else int(token)
