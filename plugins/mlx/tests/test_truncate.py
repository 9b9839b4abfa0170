"""Speculative decoding's engine side on lmdock-mlx (issue 42): verify rows mixed with decode rows,
and ``truncate`` while the decode group holds the sequence and a step has run ahead over it (the
checks are lmdock-conformance's: every logit after a truncate equals a fresh sequence's); a model
with a recurrent state cannot be cut back and says so."""

from __future__ import annotations

import os
from pathlib import Path

from lmdock.backend import SeqChunk
from lmdock_conformance.truncate import check_truncate, load_step_engine

MODELS = Path(os.environ.get("LMDOCK_MODELS", ""))


def test_truncate_gives_the_logits_of_a_sequence_without_the_dropped_tokens() -> None:
    engine = load_step_engine("mlx", str(MODELS / "stories260K"))
    try:
        assert check_truncate(engine) is None
    finally:
        engine.close()


def test_truncate_undoes_a_step_run_ahead_over_the_group() -> None:
    """Three rows decode as one group and run ahead; cutting one back leaves the other two exactly
    as they were (their run-ahead position is undone and recomputed)."""
    import numpy as np

    engine = load_step_engine("mlx", str(MODELS / "stories260K"))
    try:
        prompts = [engine.tokenizer.encode(t) for t in ("Once upon a time", "The cat sat", "Lily and Tom went")]
        lasts = [engine.step([SeqChunk(s, p, 0)]).last for s, p in enumerate(prompts)]
        tokens = [int(np.argmax(np.array(last[0]))) for last in lasts]
        out = engine.step([SeqChunk(s, [tokens[s]], len(p), argmax_next=True) for s, p in enumerate(prompts)])
        assert engine.ahead is not None and engine.group_ids == [0, 1, 2]
        assert engine.truncate(1, len(prompts[1]))  # drops the token just fed, and the step run ahead
        assert engine.ahead is None and engine.group_ids == [0, 2]
        nxt = [int(np.argmax(np.array(out.last[s]))) for s in range(3)]
        got = engine.step([SeqChunk(0, [nxt[0]], len(prompts[0]) + 1), SeqChunk(1, [tokens[1]], len(prompts[1])),
                           SeqChunk(2, [nxt[2]], len(prompts[2]) + 1)]).last
        for s in range(3):
            engine.release(s)
        for s, fed in enumerate([[tokens[0], nxt[0]], [tokens[1]], [tokens[2], nxt[2]]]):
            want = engine.step([SeqChunk(9, prompts[s] + fed, 0)]).last[0]
            engine.release(9)
            assert np.abs(np.array(got[s]) - np.array(want)).max() < 1e-3, f"row {s}"
    finally:
        engine.close()


def test_a_recurrent_state_cannot_be_truncated() -> None:
    """LFM2 (a convolution layer beside an attention layer), random weights: truncate returns False,
    so the core runs it without speculation."""
    import mlx.core as mx
    from lmdock_mlx._engine import MlxStepEngine
    from mlx_lm.models import lfm2
    from transformers import AutoTokenizer  # mlx-lm's own dependency

    args = lfm2.ModelArgs(model_type="lfm2", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=512, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                          block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                          block_ff_dim=128, rope_theta=10000.0, layer_types=["conv", "full_attention"])  # rope_theta: mlx-lm 0.30 needs it
    model = lfm2.Model(args)
    mx.eval(model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "stories260K")
    engine = MlxStepEngine(model, tokenizer, (2,), 512, 512, {}, None)
    try:
        reason = check_truncate(engine)
        assert reason is not None and "returned False" in reason
        engine.step([SeqChunk(3, [1, 403, 407, 261], 0)])
        assert engine.truncate(3, 4) is False  # even to its own length: the model cannot be cut back
    finally:
        engine.close()
