"""Speculative decoding in the step loop: propose, verify in the same batch, accept (issue 42).

Two stages of ``StepRunner._step``:

* **propose** (after scheduling, before the engine step): a decoding sequence's chunk ``[last]``
  becomes a *verify row* ``[last, d1 .. dk]`` with logits at every position, in the same step as the
  other rows.  The drafts come from the proposer (``lmdock._engine.proposers``), at most what the
  scheduler's token budget and the KV capacity leave after its plan, what ``max_tokens`` and the
  context leave, and ``num_speculative_tokens``.
* **verify** (in place of sampling for those rows): position ``j``'s logits are sampled by the
  ordinary sampler, in rounds batched over the verify rows, each token appended and checked for stops
  (``OutputProcessor.process``) before the next round: penalties, biases, grammars (the matcher advances
  with each token kept, so nothing rolls back), logprobs and stops hold per position exactly as they do
  one token a step.  A row goes on to ``j + 1`` while its sample equals ``d(j+1)``; its first sample
  that differs, or the sample after the last draft (the bonus token), ends it.  Greedy: the longest
  prefix whose argmax matches, plus one.  Sampling: with a deterministic (one-hot) proposal, keeping
  ``d`` exactly when the target's own draw is ``d`` keeps it with probability ``p(d)`` and otherwise
  gives a token from ``p`` without ``d``, renormalised, which is Leviathan et al.'s rejection rule for
  a one-hot draft; and each token uses one uniform of the sequence's own generator, as without
  speculation, so a seed gives the same tokens with speculation on and off (up to float rounding of
  the wider forward).

Afterwards the sequence keeps the KV positions of the drafts it accepted; the rest are cut off with
``truncate`` (:func:`truncate`, the one place the core calls it).  An engine without it, or whose
state cannot be cut (``fork_truncates = False``: recurrent layers), runs without speculation, which a
log line and ``stats()["spec_decode_off"]`` say.

Adaptive, per sequence, as transformers' "heuristic" schedule of assistant tokens: a proposal
kept whole lets the next one be two drafts longer (up to ``num_speculative_tokens``), any other one
drafts less (one fewer, down to one), so a verify row is as wide as the sequence's drafts have been
worth; a sequence whose one-draft proposal is rejected then waits 1, 2, 4 ... 16 steps before it proposes
again (any accepted token resets it), so text with nothing to look up costs little; with
``disable_by_batch_size`` sequences in a step or more, no row speculates (vLLM's knob).  Beam search
runs without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmdock._engine.failures import Failure
from lmdock._engine.sequence import Seq, live
from lmdock._engine.step_engine import StepEngineBase
from lmdock._plugin.contract import SeqChunk

log = logging.getLogger("lmdock.engine")

#: the longest wait (in steps) of a sequence whose proposals keep being rejected
MAX_BACKOFF = 16
#: per-sequence state held past this many sequences is pruned to the sequences of the step (a sequence
#: that ended in a step without drafts leaves its entry; a pruned one starts again from ``k``)
FORGET_AT = 4096


def truncate(engine: StepEngineBase, seq_id: int, length: int) -> bool:
    """Cut the engine's KV state of ``seq_id`` back to ``length`` positions; False when it cannot."""
    return bool(engine.truncate(seq_id, length))


def why_not(engine: StepEngineBase) -> str | None:
    """Why this engine cannot speculate (None: it can)."""
    if not engine.fork_truncates:
        return "the model's recurrent (SSM / convolution) state cannot be cut back to drop rejected drafts"
    if not engine.truncates:
        return (f"{type(engine).__name__} cannot cut rejected drafts out of its KV state (truncates = False: no "
                "truncate, or a sliding-window ring that drafts would overwrite)")
    return None


class Speculation:
    """The propose and verify stages, their back-off and their counters."""

    def __init__(self, engine: Any, config: Any, proposer: Any, budget: int, kv: Any = None) -> None:
        self.engine = engine
        self.kv = kv
        self.config = config
        self.k = config.num_speculative_tokens if proposer is not None else 0
        self.proposer = proposer
        self.budget = budget
        self.off: str | None = why_not(engine) if proposer is not None else "no speculative_config"
        if proposer is not None and self.off is not None:
            log.warning("speculative decoding is off for this model: %s", self.off)
        #: this step's drafts, by plan row
        self.drafts: dict[int, list[int]] = {}
        self._wait: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left to wait, next wait)
        self._length: dict[int, int] = {}  # seq_id -> drafts its next proposal may have (k when absent)
        self.num_drafts = 0  # verify rows
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    @property
    def enabled(self) -> bool:
        return self.off is None

    # -- propose ----------------------------------------------------------------------------------------

    def propose(self, plan: Sequence[tuple[Any, int]], chunks: list[SeqChunk], kv_room: int | None) -> None:
        """Turn the chunks of decoding sequences into verify rows (in place); remember their drafts.
        ``kv_room``: the KV positions free after the plan (None: no limit known)."""
        self.drafts = {}
        if len(self._wait) > FORGET_AT:
            self._forget(plan)
        if self.off is not None or (self.config.disable_by_batch_size and len(plan) >= self.config.disable_by_batch_size):
            return
        rows = [i for i, (seq, n) in enumerate(plan) if self._wants(seq, n, chunks[i])]
        if not rows:
            return
        room = self.budget - sum(len(c.token_ids) for c in chunks)
        if kv_room is not None:
            room = min(room, kv_room)
        seqs = [plan[i][0] for i in rows]
        try:
            proposals = self.proposer.propose(seqs, [self._limit(s) for s in seqs])
        except Exception as exc:  # a proposer that fails turns speculation off, never fails requests
            self._turn_off(f"the proposer failed: {type(exc).__name__}: {exc}")
            return
        for i, seq, draft in zip(rows, seqs, proposals):
            draft = [int(t) for t in draft[: max(0, min(self._limit(seq), room))]]
            if not draft:
                continue
            room -= len(draft)
            c = chunks[i]
            chunks[i] = SeqChunk(c.seq_id, [*c.token_ids, *draft], c.start, True, False, c.lora)
            self.drafts[i] = draft

    def _wants(self, seq: Any, n: int, chunk: SeqChunk) -> bool:
        """A decoding sequence (one pending token, output begun) of a sampled request, not waiting."""
        if not isinstance(seq, Seq) or n != 1 or chunk.all_logits or seq.num_output < 1:
            return False
        req = seq.req
        if req is None or req.beam is not None or seq.num_computed != len(seq.token_ids) - 1:
            return False
        left, nxt = self._wait.get(seq.seq_id, (0, 1))
        if left > 0:
            self._wait[seq.seq_id] = (left - 1, nxt)
            return False
        return True

    def _limit(self, seq: Seq) -> int:
        """Drafts worth proposing: ``k``, less what max_tokens or the context leave (the last
        token a sequence may have needs no draft: it is sampled anyway)."""
        limit = min(self._length.get(seq.seq_id, self.k), self.engine.max_seq_len - len(seq.token_ids))
        max_new = seq.row.params.max_new_tokens
        if max_new is not None:
            limit = min(limit, max_new - seq.num_output - 1)
        return limit

    # -- verify ------------------------------------------------------------------------------------------

    def split(self, ready: list[int]) -> list[int]:
        """Take this step's verify rows out of ``ready`` (in place); return them."""
        if not self.drafts:
            return []
        rows = [i for i in ready if i in self.drafts]
        ready[:] = [i for i in ready if i not in self.drafts]
        return rows

    def verify(
        self, plan: Sequence[tuple[Any, int]], rows: list[int], full: dict[int, Any],
        sample: Callable[[np.ndarray, list[Seq]], tuple[list[Any], list[Failure]]],
        process: Callable[[list[Seq], list[Any]], tuple[Any, list[Failure]]],
    ) -> tuple[dict[int, Any], list[Failure]]:
        """Sample the verify rows position by position; keep what matches; cut the KV state back.
        Returns the requests to report (by id) and the failures."""
        touched: dict[int, Any] = {}
        failures: list[Failure] = []
        going = [(plan[i][0], self.drafts[i], np.asarray(full[plan[i][0].seq_id])) for i in rows]
        kept = {seq.seq_id: 0 for seq, _, _ in going}
        j = 0
        while going:
            seqs = [g[0] for g in going]
            samples, failed = sample(np.stack([g[2][j] for g in going]), seqs)
            reqs, failed2 = process(seqs, samples)
            touched.update((id(r), r) for r in reqs)
            failures += failed + failed2
            bad = {id(s) for s, _ in failed + failed2}
            nxt = []
            for (seq, draft, logits), s in zip(going, samples):
                if s is None or id(seq) in bad or not live(seq) or j >= len(draft) or s.token != draft[j]:
                    continue
                kept[seq.seq_id] = j + 1
                nxt.append((seq, draft, logits))
            going, j = nxt, j + 1
        for i in rows:
            self._settle(plan[i][0], self.drafts[i], kept[plan[i][0].seq_id], failures)
        return touched, failures

    def _settle(self, seq: Seq, draft: list[int], kept: int, failures: list[Failure]) -> None:
        """Count, back off, and cut the sequence's KV state to the positions it keeps."""
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += kept
        for j in range(kept):
            self.accepted_per_pos[j] += 1
        self._adapt(seq.seq_id, len(draft), kept)
        if not live(seq) or any(f[0] is seq for f in failures):
            self._wait.pop(seq.seq_id, None)
            self._length.pop(seq.seq_id, None)
            return  # finished or failed: released already, or about to be
        seq.num_computed += kept
        self.proposer.accepted(seq, kept)
        if kept < len(draft) and not truncate(self.engine, seq.seq_id, seq.num_computed):
            self._turn_off("the engine's truncate() refused to cut a sequence back")
            self.kv.free(seq)  # its state holds rejected drafts: it is computed again from the start
            seq.num_computed = 0

    def _adapt(self, seq_id: int, drafted: int, kept: int) -> None:
        """The next proposal's length (+2 after one kept whole, else -1), and the wait after a
        rejected one-draft proposal (doubling up to ``MAX_BACKOFF`` steps)."""
        length = self._length.get(seq_id, self.k)
        self._length[seq_id] = min(self.k, length + 2) if kept == drafted else max(1, length - 1)
        _, nxt = self._wait.get(seq_id, (0, 1))
        self._wait[seq_id] = (0, 1) if kept or length > 1 else (nxt, min(2 * nxt, MAX_BACKOFF))

    def _forget(self, plan: Sequence[tuple[Any, int]]) -> None:
        ids = {seq.seq_id for seq, _ in plan}
        self._wait = {i: w for i, w in self._wait.items() if i in ids}
        self._length = {i: n for i, n in self._length.items() if i in ids}

    def _turn_off(self, reason: str) -> None:
        if self.off is None:
            self.off = reason
            log.warning("speculative decoding turned off: %s", reason)

    # -- counters ---------------------------------------------------------------------------------------

    def room(self, plan: Any, scheduler: Any) -> int | None:
        """KV positions free after the plan (None: the engine names no capacity, or no speculation)."""
        capacity = scheduler.capacity or (self.kv.capacity if self.kv is not None else None)
        if capacity is None or not self.enabled:
            return None
        planned = {id(s): n for s, n in plan}
        running = scheduler.running or [s for s, _ in plan]  # a scheduler that shows none: the plan
        return capacity - sum(s.num_computed + planned.get(id(s), 0) for s in running)

    def stats(self) -> dict[str, Any]:
        """vLLM's spec-decode counters (``/metrics`` and ``LLM.stats()``)."""
        drafts = self.num_draft_tokens
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": drafts,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / drafts if drafts else 0.0,
            "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "spec_decode_off": self.off if self.proposer is not None else None,
        }

    def sweep(self) -> None:
        """Let the proposer free what it holds for sequences that ended (its optional ``sweep``)."""
        sweep = getattr(self.proposer, "sweep", None)
        if sweep is not None:
            try:
                sweep()
            except Exception as exc:
                self._turn_off(f"the proposer failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self.proposer is not None:
            try:
                self.proposer.close()
            except Exception:
                log.exception("closing the speculative proposer failed")
