"""A recurrent hybrid (a tiny random-weight Bamba: a Mamba-2 layer and an attention layer, made by
data/make_hybrid.py with llama.cpp's own converter) against transformers' greedy tokens for it.

A recurrent state holds everything up to its sequence's last position and cannot be cut back, so
the engine forks such a model only at the source's full length; before, a prefix-cache hit copied
the whole state of the cached prompt and later requests came out wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lmdock_llamacpp
import numpy as np
import pytest
from lmdock import LLM, BackendError, ModelConfig, SamplingParams
from lmdock.backend import SeqChunk
from lmdock_llamacpp import LlamaCppOptions

DATA = Path(__file__).parent / "data"
HYBRID = DATA / "bamba-tiny.gguf"
CASE = json.loads((DATA / "bamba-tiny.json").read_text())
PROMPTS, REFERENCE = CASE["prompts"], CASE["reference"]
NEW = len(REFERENCE[0])


def _generate(llm: LLM, indexes: list[int]) -> list[list[int]]:
    outs = llm.generate([PROMPTS[i] for i in indexes], SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_hybrid_matches_transformers(prefix_caching: bool) -> None:
    with LLM(str(HYBRID), backend="llamacpp", kv_cache={"enable_prefix_caching": prefix_caching}) as llm:
        assert _generate(llm, [0]) == [REFERENCE[0]]  # one prompt
        assert _generate(llm, [1, 2, 3, 4]) == [REFERENCE[i] for i in (1, 2, 3, 4)]  # a mixed batch in one call
        # one after another in the same LLM: the 24-token prompt, then one that extends it (a hit at the
        # cached prompt's full length), one inside it (22 tokens: no partial state to fork), the first again
        for i in (5, 6, 3, 0, 5):
            assert _generate(llm, [i]) == [REFERENCE[i]], f"prompt {i}"


def _engine() -> Any:
    from lmdock_llamacpp._engine import load

    mc = ModelConfig(model=str(HYBRID), backend="llamacpp")
    build = lmdock_llamacpp.plugin.lmdock_translate_build_config(backend="llamacpp", model_config=mc)
    return load(mc, LlamaCppOptions(), None, build)


def test_a_recurrent_state_forks_only_whole() -> None:
    engine = _engine()
    try:
        assert engine.recurrent
        prompt = PROMPTS[0]
        engine.step([SeqChunk(0, prompt, 0)])
        assert not engine.fork(0, 1, len(prompt) - 5)  # the state cannot be cut back to a prefix
        assert engine.fork(0, 1, len(prompt))
        nxt = REFERENCE[0][0]
        out = engine.step([SeqChunk(0, [nxt], len(prompt)), SeqChunk(1, [nxt], len(prompt))]).last
        assert out[0].argmax() == out[1].argmax() == REFERENCE[0][1]  # both continue as transformers does
        assert np.abs(out[0] - out[1]).max() < 1e-3  # one state, two rows: equal up to float rounding
    finally:
        engine.close()


def test_a_failed_memory_call_is_an_error_naming_it() -> None:
    """Continuing a recurrent sequence from an earlier position needs a partial llama_memory_seq_rm,
    which llama.cpp refuses: that is an error, not a state silently left as it was."""
    engine = _engine()
    try:
        engine.step([SeqChunk(0, PROMPTS[0], 0)])
        with pytest.raises(BackendError, match="llama_memory_seq_rm failed.*recurrent state cannot be cut back"):
            engine.step([SeqChunk(0, PROMPTS[0][10:12], 10)])
    finally:
        engine.close()
