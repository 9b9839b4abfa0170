"""Contained sampling: one batch-wide call into the sampler, and a failing row fails its request alone.

Constraint masks come first (:func:`lmdock._engine.constraints.mask_rows`).  If the batch-wide
``sampler.sample`` raises (a plugin's logits processor, say), the batch is sampled again row by row
from the same random states, so the rows that succeed get the same tokens either way; the rows that
raise come back as failures, with no sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmdock._engine.constraints import mask_rows
from lmdock._engine.failures import Failure, as_request_error
from lmdock._engine.sampler import Sample, Sampler, host_array
from lmdock._engine.sequence import Seq


def sample_contained(
    sampler: Sampler, logits: Any, seqs: list[Seq], fill_masks: Callable[..., None] | None = None
) -> tuple[list[Sample | None], list[Failure]]:
    """A sample per sequence (None where its row failed), and the failures."""
    # Rows with logits processors run plugin code that may raise after other rows have drawn:
    # their generators are saved first so a retry row by row draws the same numbers.
    saved = [(s.row, s.row.rng.bit_generator.state) for s in seqs if not s.row.params.greedy] if any(s.row.processors for s in seqs) else None
    failures: list[Failure] = []
    if any(s.constraint is not None for s in seqs):  # grammar masks are made on the host
        logits, failures = mask_rows(host_array(logits), seqs, fill_masks)
    try:
        return list(sampler.sample(logits, [s.row for s in seqs])), failures
    except Exception:
        for row, state in saved or ():
            row.rng.bit_generator.state = state
    out: list[Sample | None] = []
    for i, seq in enumerate(seqs):
        try:
            out.append(sampler.sample(logits[i : i + 1], [seq.row])[0])
        except Exception as exc:
            failures.append((seq, as_request_error(exc, "sampling")))
            out.append(None)
    return out, failures
