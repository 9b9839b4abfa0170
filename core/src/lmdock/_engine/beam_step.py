"""Beam search in the loop: one step for each beam request whose live beams all have their logits.

Each beam's children come from :func:`lmdock._engine.beam.beam_choices`; a beam keeps its own sequence
for its first child and forks its KV state for the others (engines that cannot fork recompute them);
a beam without children is pruned and released at once.  The requests whose search ended (or raised)
come back to the loop to finish, in order, as :data:`Ending` triples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np

from lmdock._engine.beam import beam_choices
from lmdock._engine.failures import as_request_error
from lmdock._engine.kv import KV
from lmdock._engine.sampler import log_softmax
from lmdock._engine.scheduler import SchedulerBase
from lmdock._engine.sequence import Req, Seq
from lmdock._plugin.errors import LmdockError

#: A request to finish: ``(request, finish reason, error or None)``.
Ending: TypeAlias = "tuple[Req, str, LmdockError | None]"


class BeamStepper:
    def __init__(self, kv: KV, scheduler: SchedulerBase, new_seq_id: Callable[[], int], eos_token_ids: Sequence[int], max_seq_len: int) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.new_seq_id = new_seq_id
        self.eos_token_ids = eos_token_ids
        self.max_seq_len = max_seq_len

    def step(self, seqs: list[Seq], logits: np.ndarray) -> list[Ending]:
        """Record each beam's log-softmax; advance the requests whose live beams all have one."""
        lps = log_softmax(logits)
        reqs: dict[int, Req] = {}
        for seq, lp in zip(seqs, lps):
            seq.beam_lp = lp
            reqs[id(seq.req)] = seq.req  # type: ignore[assignment]
        endings: list[Ending] = []
        for req in reqs.values():
            live = [s for s in req.seqs if s.finish_reason is None]
            if req.done or not all(s.beam_lp is not None for s in live):
                continue
            try:
                if self._advance(req, live):
                    endings.append((req, "length", None))
            except Exception as exc:
                endings.append((req, "abort", as_request_error(exc, "beam search")))
        return endings

    def _advance(self, req: Req, live: list[Seq]) -> bool:
        """Advance one beam request once every live beam has its logits; True when the search is done."""
        assert req.beam is not None  # noqa: S101 - only called for beam requests
        children = beam_choices(req.beam, req.request.params, live, self.eos_token_ids, self.max_seq_len)
        for seq, mine in zip(live, children):
            seq.beam_lp = None
            for c in mine[1:]:  # extra children copy the parent's KV state before it moves on
                child = seq.fork(self.new_seq_id())
                if not (seq.held and self.kv.fork(seq.seq_id, child, seq.num_computed)):
                    child.num_computed = 0
                child.token_ids.append(c.token)
                child.cumulative_logprob = c.logprob
                req.seqs.append(child)
                self.scheduler.fork(seq, child)  # keeps the new beam beside its parent
            if mine:
                seq.token_ids.append(mine[0].token)
                seq.cumulative_logprob = mine[0].logprob
            else:
                seq.finish_reason = "pruned"
                self.kv.release(seq)
        req.seqs = [s for s in req.seqs if s.finish_reason != "pruned"]
        return req.beam.done
