"""Speculative proposers: what the verify stage checks (``lmdock._engine.speculative``).

A proposer answers ``propose(seqs, limits)`` with at most ``limits[i]`` draft tokens for each
sequence (an empty list: nothing to propose, the sequence decodes as usual), and hears after the
verify stage how many of them the target kept (``accepted``), so a proposer with state of its own (a
draft model's KV) cuts it back.  ``close()`` frees what it holds.  Proposals are deterministic (a
draft model proposes its argmax), so a proposal is a one-hot draft distribution: accepting a token
exactly when the target's own sample equals it is Leviathan et al.'s rejection rule for that case
(``docs/speculative.md``).

Plugins add proposers through the ``lmdock_speculative_proposer`` hook; the two built in here are
registered by the core's builtin plugin:

* :class:`NgramProposer`: prompt lookup (vLLM's ``ngram``, transformers' ``prompt_lookup_num_tokens``):
  the longest suffix of the sequence, ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, that
  occurred before in the prompt or the output; the tokens that followed its latest occurrence.
* :class:`DraftProposer`: a smaller model sharing the tokenizer, as a step engine with its own KV state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from lmdock._engine.kv import KV
from lmdock._plugin.contract import SeqChunk

log = logging.getLogger("lmdock.engine")


class Proposer(Protocol):
    def propose(self, seqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        """At most ``limits[i]`` draft tokens to follow ``seqs[i].token_ids``."""
        ...

    def accepted(self, seq: Any, kept: int) -> None:
        """The target kept ``kept`` tokens of the sequence's last proposal."""
        ...

    def close(self) -> None: ...

    # optional: ``sweep()``, called every loop iteration, frees what ended sequences held


class NgramIndex:
    """One sequence's n-grams (``lo``..``hi`` tokens) by where they last ended, grown as it grows.

    The n-grams ending at the last token are left out until the next token comes: looking the
    sequence's own suffix up must find an earlier occurrence."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        ends, lo, hi = self.ends, self.lo, self.hi
        for end in range(self.upto, len(tokens) - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.upto = max(self.upto, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        self.update(tokens)
        for n in range(min(self.hi, len(tokens)), self.lo - 1, -1):
            end = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class NgramProposer:
    """Prompt lookup over the prompt and the output so far (no model, no KV state)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._index: dict[int, tuple[Any, NgramIndex]] = {}

    def propose(self, seqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        self._forget_finished()
        out = []
        for seq, k in zip(seqs, limits):
            held = self._index.get(seq.seq_id)
            if held is None or held[0] is not seq:
                held = self._index[seq.seq_id] = (seq, NgramIndex(self.lo, self.hi))
            out.append(held[1].lookup(seq.token_ids, k))
        return out

    def accepted(self, seq: Any, kept: int) -> None:
        pass  # the index grows with the sequence's own tokens

    def _forget_finished(self) -> None:
        gone = [i for i, (s, _) in self._index.items() if s.finish_reason is not None or (s.req is not None and s.req.done)]
        for i in gone:
            del self._index[i]

    def close(self) -> None:
        self._index.clear()


class DraftProposer:
    """A draft model as a step engine: each proposal feeds what the draft has not seen yet, then
    proposes its argmax ``k`` times, one token per sequence per draft step, batched over sequences.
    Its KV state is cut back to what the target kept (``truncate``), and released when the sequence ends."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.kv = KV(engine, None)  # type: ignore[arg-type]  # the draft's own state: no scheduler
        self._held: dict[int, tuple[Any, int]] = {}  # seq_id -> (sequence, positions the draft computed)

    def propose(self, seqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        self._release_finished()
        out: list[list[int]] = [[] for _ in seqs]
        rows = [i for i, k in enumerate(limits) if k > 0]
        if not rows:
            return out
        chunks = []
        for i in rows:
            seq = seqs[i]
            held = self._held.get(seq.seq_id)
            done = held[1] if held is not None and held[0] is seq else 0
            done = min(done, len(seq.token_ids) - 1)
            chunks.append(SeqChunk(seq.seq_id, list(seq.token_ids[done:]), done, False))
        for _ in range(max(limits[i] for i in rows)):
            result = self.engine.step(chunks)
            tokens = np.asarray(_host(result.last)).argmax(axis=-1).tolist()
            nxt = []
            for (i, chunk), tok in zip(zip(rows, chunks), tokens):
                seq = seqs[i]
                self._held[seq.seq_id] = (seq, chunk.start + len(chunk.token_ids))
                out[i].append(int(tok))
                if len(out[i]) < limits[i]:
                    nxt.append((i, SeqChunk(seq.seq_id, [int(tok)], chunk.start + len(chunk.token_ids), False)))
            rows, chunks = [i for i, _ in nxt], [c for _, c in nxt]
            if not rows:
                break
        return out

    def accepted(self, seq: Any, kept: int) -> None:
        """The draft's positions past the tokens the target kept are cut (the last proposal was fed
        from ``len(token_ids) - kept - 1`` on)."""
        held = self._held.get(seq.seq_id)
        if held is None:
            return
        valid = len(seq.token_ids) - 1  # every token but the last is the target's now
        if held[1] > valid:
            if self.engine.truncate(seq.seq_id, valid):
                self._held[seq.seq_id] = (seq, valid)
            else:  # cannot cut back: start this sequence's draft state again
                self._drop(seq.seq_id)

    def sweep(self) -> None:
        """Release the draft state of sequences that ended (the loop calls it every iteration)."""
        if self._held:
            self._release_finished()

    def _release_finished(self) -> None:
        for seq_id, (seq, _) in list(self._held.items()):
            if seq.finish_reason is not None or seq.req is None or seq.req.done:
                self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)
        self.kv.release_ids([seq_id])  # guarded as every release is

    def close(self) -> None:
        for seq_id in list(self._held):
            self._drop(seq_id)
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the draft engine failed")


def _host(logits: Any) -> Any:
    if hasattr(logits, "detach"):
        return logits.detach().float().cpu().numpy()
    return logits
