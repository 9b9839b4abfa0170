"""Speculative decoding's engine side on lmdock-llamacpp (issue 42): verify rows mixed with decode
rows, and ``truncate`` as a partial ``llama_memory_seq_rm`` (the checks are lmdock-conformance's:
every logit after a truncate equals a fresh sequence's); a recurrent hybrid cannot be cut back and
says so, leaving its state as it was."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from lmdock.backend import SeqChunk
from lmdock_conformance.truncate import check_truncate, load_step_engine

GGUF = Path(os.environ.get("LMDOCK_MODELS", "")) / "stories260K-gguf" / "stories260K.gguf"
HYBRID = Path(__file__).parent / "data" / "bamba-tiny.gguf"


def test_truncate_gives_the_logits_of_a_sequence_without_the_dropped_tokens() -> None:
    engine = load_step_engine("llamacpp", str(GGUF))
    try:
        assert engine.fork_truncates and check_truncate(engine) is None
        engine.step([SeqChunk(0, [1, 403, 407, 261, 378], 0)])
        assert engine.truncate(0, 3) and engine._length[engine._llama_seq[0]] == 3
    finally:
        engine.close()


def test_a_recurrent_state_cannot_be_truncated() -> None:
    engine = load_step_engine("llamacpp", str(HYBRID))
    try:
        assert engine.recurrent and not engine.fork_truncates  # the core knows before any speculation
        reason = check_truncate(engine)
        assert reason is not None and "returned False" in reason
        prompt = [1, 403, 407, 261, 378, 432, 383]
        before = engine.step([SeqChunk(0, prompt, 0)]).last[0]
        assert engine.truncate(0, 5) is False
        # the state is untouched: the same next step as a sequence that was never asked to truncate
        got = engine.step([SeqChunk(0, [286], len(prompt))]).last[0]
        engine.step([SeqChunk(1, prompt, 0)])
        want = engine.step([SeqChunk(1, [286], len(prompt))]).last[0]
        assert np.abs(got - want).max() < 1e-3 and before.shape == got.shape
    finally:
        engine.close()
