"""Sliding-window layers keep only their window in lmdock-hf's slot cache (``lmdock_hf._window``),
and the tokens still equal transformers' own greedy generate (float32, eager) past the window.

Tiny random-weight models from the conformance zoo's builder (``lmdock_conformance.zoo.random_model``):
a Gemma-3-like 5 sliding : 1 full model and a Mistral-like one whose every layer is windowed, with a
window of 8 below prompts of 7-31 tokens and 24 new ones.  Prefill runs as one chunk wider than the
window and in chunks of 5 that cross it; forks where the window is held (a prompt extending a cached
one, ``n = 2``) and one where it is not (a prompt sharing only part of a longer cached prompt: a
miss, computed again); LoRA on the windowed model against PEFT.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from families import TOKENIZER_FILES, reference, same_up_to_ties
from lmdock import LLM, LoRARequest, SamplingParams

WINDOW = 8
NEW = 24
_BASE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "sliding_window": WINDOW,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-5to1": ("gemma3_text", {"num_hidden_layers": 6, "query_pre_attn_scalar": 32,
                                    "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "mistral": ("mistral", {"num_hidden_layers": 2}),
}
_rng = random.Random(3)
PROMPTS = [[1] + [_rng.randrange(3, 512) for _ in range(n)] for n in (30, 6, 21, 13)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


def _save(model: Any, out: Path, stories: str) -> Path:
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(stories) / name).exists():
            shutil.copy(Path(stories) / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, stories: str) -> Path:
    from lmdock_conformance.zoo import random_model

    model_type, extra = MODELS[request.param]
    return _save(random_model(model_type, {**_BASE, **extra}), tmp_path_factory.mktemp(request.param), stories)


@pytest.fixture(scope="module")
def refs(windowed: Path) -> dict[tuple[int, ...], Any]:
    prompts = [*PROMPTS, _extending(), _partial(), _short_partial()]
    return {tuple(p): r for p, r in zip(prompts, reference(windowed, prompts, NEW))}


def _extending() -> list[int]:
    return PROMPTS[0] + [7, 8, 9, 10, 11]  # extends all of PROMPTS[0]


def _partial() -> list[int]:
    return PROMPTS[0][:20] + [12, 13, 14, 15]  # shares 20 of PROMPTS[0]'s 31 tokens (past the window)


def _short_partial() -> list[int]:
    return PROMPTS[1][:5] + [16, 17, 18]  # shares 5 of PROMPTS[1]'s 7 (all within one window)


def _same(llm: LLM, prompt: list[int], refs: dict[tuple[int, ...], Any], what: str, params: SamplingParams = GREEDY) -> None:
    for completion in llm.generate([prompt], params)[0].outputs:
        assert same_up_to_ties(list(completion.token_ids), refs[tuple(prompt)]), f"{what}: {completion.token_ids} != {refs[tuple(prompt)][0]}"


def _held(engine: Any) -> tuple[list[int], list[int]]:
    """Positions a slot holds per layer: (sliding layers, full layers)."""
    cache = engine.cache
    sliding = [int(cache.k[i].shape[2]) for i in range(len(cache.k)) if i in engine.kv_windows]
    full = [int(cache.k[i].shape[2]) for i in range(len(cache.k)) if i not in engine.kv_windows]
    return sliding, full


@pytest.mark.parametrize("chunk", [5, 2048], ids=["chunks-of-5", "one-chunk"])
def test_sliding_layers_hold_only_their_window_and_tokens_equal_generate(windowed: Path, refs: Any, chunk: int) -> None:
    """A batch of mixed lengths, then each prompt alone (slots released and refilled), prefilled in
    chunks of 5 crossing the window of 8 or in one chunk wider than it."""
    with LLM(str(windowed), backend="hf", scheduler={"max_num_batched_tokens": chunk}) as llm:
        batch = llm.generate(PROMPTS, GREEDY)
        for i, out in enumerate(batch):
            assert same_up_to_ties(list(out.outputs[0].token_ids), refs[tuple(PROMPTS[i])]), f"batch row {i}"
        for i, prompt in enumerate(PROMPTS):
            _same(llm, prompt, refs, f"alone {i}")
        engine = llm.engine.engine
        sliding, full = _held(engine)
        assert engine.kv_windows and sliding and all(n == WINDOW for n in sliding)
        assert all(n >= len(PROMPTS[0]) + NEW for n in full)  # a full layer holds the whole context


def test_forks_where_the_window_is_held_and_a_miss_where_it_is_not(windowed: Path, refs: Any) -> None:
    with LLM(str(windowed), backend="hf", kv_cache={"enable_prefix_caching": True}) as llm:
        _same(llm, PROMPTS[0], refs, "first")
        _same(llm, _extending(), refs, "extending the cached prompt")
        hits = llm.stats()["prefix_cache_hit_tokens"]
        assert hits == len(PROMPTS[0])  # forked where the ring stands
        _same(llm, _partial(), refs, "sharing 20 of 31 cached tokens")
        assert llm.stats()["prefix_cache_hit_tokens"] == hits  # the ring moved past position 20: computed again
        _same(llm, PROMPTS[1], refs, "a prompt shorter than the window")
        _same(llm, _short_partial(), refs, "sharing 5 of a 7-token cached prompt")
        assert llm.stats()["prefix_cache_hit_tokens"] == hits + 5  # a ring that never wrapped holds every position
        _same(llm, PROMPTS[2], refs, "n = 2", SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, n=2))
        assert llm.stats()["prefix_caching"] == "prefixes"


def test_a_fork_copies_the_ring_only_where_the_window_is_held(windowed: Path) -> None:
    """The engine's fork, directly: ``length`` at most one position behind where the source stands
    (or a source that never filled its ring); a refused fork takes no slot."""
    from lmdock.backend import SeqChunk

    with LLM(str(windowed), backend="hf") as llm:
        engine = llm.engine.engine
        engine.step([SeqChunk(seq_id=100, start=0, token_ids=PROMPTS[0])])
        assert engine.fork(100, 101, len(PROMPTS[0])) and engine.fork(100, 102, len(PROMPTS[0]) - 1)
        assert not engine.fork(100, 103, len(PROMPTS[0]) - 2) and 103 not in engine.cache.slot_of
        engine.step([SeqChunk(seq_id=104, start=0, token_ids=PROMPTS[1])])
        assert engine.fork(104, 105, 2)
        slots = engine.cache.slot_of
        for layer in engine.kv_windows:
            assert torch.equal(engine.cache.k[layer][slots[101]], engine.cache.k[layer][slots[100]])
        for seq in (100, 101, 102, 104, 105):
            engine.release(seq)


def test_entry_positions_follow_a_ring_written_position_by_position() -> None:
    """Against a ring simulated one write at a time: each entry's token position, before the ring
    reached its full size and after it wrapped."""
    from lmdock_hf._window import entry_positions

    ring = 5
    for size in (3, ring):
        entries = [-1] * size
        for last in range(size if size < ring else 3 * ring):
            entries[last % ring] = last
            got = entry_positions(torch.tensor([last]), size, ring)[0].tolist()
            assert [g if g >= 0 else -1 for g in got] == entries, (size, last)


def test_lora_on_a_windowed_model_equals_peft(windowed: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft (a test tool: scripts/test.sh installs it into the hf env)")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    ref = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32, attn_implementation="eager"), str(tmp_path / "adapter")).eval()
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    with LLM(str(windowed), backend="hf") as llm:
        got = llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", tmp_path / "adapter"))[0].outputs[0].token_ids
    assert list(got) == want[0, len(PROMPTS[0]):].tolist()
