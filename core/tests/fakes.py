"""A FAKE step backend for testing the core's plumbing (scheduler, sampler, loop, facade).

It is not an engine: its "model" is a fixed random bigram table.  It checks that the core drives the
step-engine contract correctly (each chunk starts where the sequence's KV state ends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lmdock
import numpy as np
from lmdock.backend import BackendSpec, SeqChunk, StepOutput

SPECIALS = ["<unk>", "<s>", "</s>"]
PIECES = SPECIALS + list("abcdefghijklmnopqrstuvwxyz .,!") + ["ab", "cde", "xyz", "é"]


class FakeTokenizer:
    """Greedy longest-match tokenizer over PIECES; BOS = 1, EOS = 2."""

    bos_token_id = 1
    eos_token_id = 2
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [1] if add_special_tokens else []
        i = 0
        while i < len(text):
            for piece in sorted(PIECES[3:], key=len, reverse=True):
                if text.startswith(piece, i):
                    ids.append(PIECES.index(piece))
                    i += len(piece)
                    break
            else:
                ids.append(0)
                i += 1
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[t] for t in token_ids if not (skip_special_tokens and t < 3))

    def apply_chat_template(self, conversation: list[dict[str, Any]], chat_template: str | None = None, add_generation_prompt: bool = True, tokenize: bool = False, **kw: Any) -> str:
        if chat_template is None:
            raise ValueError("no template")
        return "".join(m["content"] for m in conversation)


class FakeStepEngine:
    """Bigram logits from a seeded table, or from ``logits_fn(tokens)`` when given."""

    def __init__(self, logits_fn: Callable[[list[int]], np.ndarray] | None = None, max_seq_len: int = 256, kv_capacity_tokens: int | None = None, seed: int = 0) -> None:
        self.tokenizer = FakeTokenizer()
        self.vocab_size = len(PIECES)
        self.max_seq_len = max_seq_len
        self.eos_token_ids = (2,)
        self.generation_config: dict[str, Any] = {}
        self.kv_capacity_tokens = kv_capacity_tokens
        self.table = np.random.default_rng(seed).normal(0, 3, (self.vocab_size, self.vocab_size)).astype(np.float32)
        self.logits_fn = logits_fn or (lambda toks: self.table[toks[-1]].copy())
        self.state: dict[int, list[int]] = {}
        self.steps = 0
        self.max_live = 0
        self.max_tokens = 0
        self.released: set[int] = set()
        self.restarts = 0
        self.closed = False
        #: SeqChunk.argmax_next checked: the token each sequence was promised next, how many promises
        #: were made, and those broken (seq_id, promised, fed)
        self.promised: dict[int, int] = {}
        self.promises = 0
        self.broken: list[tuple[int, int, int]] = []

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        self.steps += 1
        last = np.empty((len(chunks), self.vocab_size), dtype=np.float32)
        full = {}
        for i, c in enumerate(chunks):
            if c.start == 0 and c.seq_id in self.released:
                self.restarts += 1  # recomputed after a preemption
                self.released.discard(c.seq_id)
            want = self.promised.pop(c.seq_id, None)
            if want is not None and c.token_ids[0] != want:
                self.broken.append((c.seq_id, want, c.token_ids[0]))
            held = self.state.setdefault(c.seq_id, [])
            if c.start != len(held):
                raise AssertionError(f"chunk for seq {c.seq_id} starts at {c.start}, KV holds {len(held)}")
            rows = []
            for t in c.token_ids:
                held.append(t)
                rows.append(self.logits_fn(list(held)))
            last[i] = rows[-1]
            if c.all_logits:
                full[c.seq_id] = np.stack(rows)
            if c.argmax_next:
                self.promised[c.seq_id] = int(last[i].argmax())
                self.promises += 1
        self.max_live = max(self.max_live, len(self.state))
        self.max_tokens = max(self.max_tokens, sum(len(v) for v in self.state.values()))
        return StepOutput(last, full)

    def release(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)
        self.promised.pop(seq_id, None)
        self.released.add(seq_id)

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        return False

    def num_sequences(self) -> int:
        return len(self.state)

    def close(self) -> None:
        self.closed = True


class FakePlugin:
    """Registers backend "fake"; the engine it loads is ``factory()``."""

    def __init__(self, factory: Callable[[], FakeStepEngine] = FakeStepEngine) -> None:
        self.factory = factory
        self.engines: list[FakeStepEngine] = []

    @lmdock.hookimpl
    def lmdock_register_backends(self, register: Any) -> None:
        register(BackendSpec(name="fake", kind="step", plugin_api="1.0", supports=frozenset({"generate"}), lacks={"chat": "the fake has no template"}, description="FAKE test backend"))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend: str, model_config: Any, options: Any, quantization: Any, build: Any) -> Any:
        if backend != "fake":
            return None
        engine = self.factory()
        self.engines.append(engine)
        return engine
