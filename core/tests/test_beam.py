"""lmdock.backend.BeamSearch: the dense step and the top-k step (a request engine's) are one search."""

from __future__ import annotations

import numpy as np
import pytest
from lmdock.backend import BeamSearch


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_top_k_rows_drive_the_search_as_the_dense_step_does(length_penalty: float, early_stopping: bool) -> None:
    rng = np.random.default_rng(0)
    width, vocab, ends = 3, 40, {0, 7}
    end_mask = np.zeros(vocab, dtype=bool)
    end_mask[list(ends)] = True
    dense, top = BeamSearch(width, length_penalty, early_stopping), BeamSearch(width, length_penalty, early_stopping)
    beams = [([], 0.0)]
    for step in range(12):
        logits = rng.normal(size=(len(beams), vocab)) * 2
        lps = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        outputs = [b[0] for b in beams]
        running = np.array([b[1] for b in beams])
        at_limit = step == 11
        a = dense.step(outputs, running, lps, end_mask, at_limit)
        # each beam's top 2 * width, as vLLM reports them
        rows = [{int(t): float(row[t]) for t in np.argsort(-row, kind="stable")[: 2 * width]} for row in lps]
        b = top.step_top(outputs, list(running), rows, ends, at_limit, mask_ends=False)
        assert [(c.beam, c.token) for c in a] == [(c.beam, c.token) for c in b]
        assert [c.logprob for c in a] == pytest.approx([c.logprob for c in b])
        assert [h.token_ids for h in dense.hyps] == [h.token_ids for h in top.hyps]
        assert dense.done == top.done
        if dense.done:
            break
        beams = [([*outputs[c.beam], c.token], c.logprob) for c in a]
    assert dense.done and dense.hyps  # the search ran to an end with finished hypotheses
