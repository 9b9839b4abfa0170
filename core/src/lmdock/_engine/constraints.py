"""Output constraints for step engines (structured output): the interface the loop drives.

A constraint belongs to one sequence (each of a request's ``n`` completions has its own).  Each step,
before sampling, the loop asks every constrained sequence in the batch for the tokens it allows and
masks the rest of its logits row to ``-inf`` in one vectorized operation (so logprobs are those of the
constrained distribution, as vLLM reports them); after the token is appended it tells the constraint,
and a constraint that is complete (its grammar can take no more tokens) ends the sequence with
``finish_reason="stop"``.

:func:`mask_rows` is what the loop calls: one batched mask, and when a constraint raises, row by row,
so that constraint's request fails alone.

``make_constraints(params, tokenizer, vocab_size, n)`` returns ``n`` constraints for a request, or None
when the request has no ``structured_output``; it raises :class:`lmdock.RequestError` for a grammar or
schema that cannot be compiled (that request fails alone, at submit).  The implementation on llguidance
lives in ``lmdock._engine.structured``; this module only states the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lmdock._engine.failures import Failure, as_request_error

if TYPE_CHECKING:
    from lmdock._engine.sequence import Seq


class Constraint(Protocol):
    def allowed(self, out: np.ndarray) -> None:
        """Write the tokens allowed next into ``out`` (a bool row of the vocabulary's size, all False)."""
        ...

    def accept(self, token: int) -> None:
        """The sequence took ``token`` (always one ``allowed`` permitted)."""
        ...

    def is_complete(self) -> bool:
        """No further token is possible: the sequence stops here."""
        ...


class ConstraintBatch(Protocol):
    """Optional: fills the masks of several constraints at once (llguidance's batched executor)."""

    def fill(self, constraints: Sequence[Constraint], out: np.ndarray) -> None: ...


def apply_masks(logits: np.ndarray, constraints: Sequence[Any], fill: Any = None) -> np.ndarray:
    """Mask the rows of ``logits`` whose constraint is not None; returns ``logits`` (a copy when changed)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    mask = np.zeros((len(rows), logits.shape[1]), dtype=bool)
    active = [constraints[i] for i in rows]
    if fill is not None:
        fill(active, mask)
    else:
        for j, c in enumerate(active):
            c.allowed(mask[j])
    out = logits.copy()
    sub = out[rows]
    sub[~mask] = -np.inf
    out[rows] = sub
    return out


def mask_rows(logits: np.ndarray, seqs: Sequence[Seq], fill: Callable[..., None] | None = None) -> tuple[np.ndarray, list[Failure]]:
    """Mask the logits of the constrained sequences (``fill``: a batched mask filler,
    ``ConstraintBatch.fill``).  If that raises, find the failing constraints row by row: their
    sequences come back as failures, and their rows are left unmasked."""
    try:
        return apply_masks(logits, [s.constraint for s in seqs], fill), []
    except Exception:  # one constraint's failure: find it row by row
        pass
    failures: list[Failure] = []
    cons: list[Any] = []
    for seq in seqs:
        c = seq.constraint
        if c is not None:
            try:
                apply_masks(logits[:1], [c])
            except Exception as exc:
                failures.append((seq, as_request_error(exc, "structured output")))
                c = None
        cons.append(c)
    return apply_masks(logits, cons), failures
