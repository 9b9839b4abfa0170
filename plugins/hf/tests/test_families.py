"""lmdock-hf runs each model family exactly as transformers' own greedy generate (float32, eager).

Tiny random-weight checkpoints (``families.py``): windows of 16 below sequences of 8-31 prompt
tokens + 48 new ones, Gemma 2's soft-capping, gpt-oss's sinks, MoE, and hybrids whose conv / SSM
layers keep recurrent state per slot.  Per family, in one ``LLM`` with prefix caching on: a batch
of four prompts of mixed lengths in one call, the same prompts again one after another (state left
behind by finished or cached sequences would show), a prompt extending a cached one (a prefix-cache
hit: for a recurrent model only whole cached prompts are reused), and ``n = 2``.  Exact token
equality; a divergence where the reference's top two logits were within 1e-3 counts as a tie.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from families import FAMILIES, build, known, reference, same_up_to_ties
from lmdock import LLM, SamplingParams, UnsupportedError

NEW = 48
_rng = random.Random(0)
PROMPTS = [[1] + [_rng.randrange(3, 512) for _ in range(n)] for n in (30, 7, 22, 13)]
EXTENDED = PROMPTS[1] + [_rng.randrange(3, 512) for _ in range(6)]  # extends all of PROMPTS[1]
HYBRIDS = {"falcon_h1", "bamba", "lfm2", "granitemoehybrid", "qwen3_next"}
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory, stories: str) -> Path:
    return tmp_path_factory.mktemp("families")


def _family(zoo: Path, stories: str, family: str) -> Path:
    path = build(family, zoo, Path(stories))
    assert path is not None
    return path


def _states_api() -> bool:
    """transformers' linear-attention Cache API (5.21+), through which lmdock-hf keeps hybrids' state."""
    from lmdock_hf._family import states_api

    return states_api()


#: the families the installed transformers has (older releases lack the newer ones)
INSTALLED = [f for f in FAMILIES if known(f)]


def _same(ours: list[int], ref: Any, what: str) -> None:
    assert same_up_to_ties(ours, ref), f"{what}: lmdock-hf {ours} != transformers {ref[0]}"


@pytest.mark.parametrize("family", INSTALLED)
def test_family_equals_transformers_generate(zoo: Path, stories: str, family: str) -> None:
    path = _family(zoo, stories, family)
    if family in HYBRIDS and not _states_api():
        with pytest.raises(UnsupportedError, match=rf"a {family} model with recurrent-state .*lacks 'recurrent_state'.*transformers>=5\.21"):
            LLM(str(path), backend="hf")
        return
    refs = reference(path, [*PROMPTS, EXTENDED], NEW)
    with LLM(str(path), backend="hf", kv_cache={"enable_prefix_caching": True}) as llm:
        batch = llm.generate(PROMPTS, GREEDY)
        for i, out in enumerate(batch):
            _same(out.outputs[0].token_ids, refs[i], f"batch row {i}")
        for i, prompt in enumerate(PROMPTS):  # back to back, each prompt cached by the batch before
            _same(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids, refs[i], f"alone {i}")
        hits = llm.stats()["prefix_cache_hit_tokens"]
        _same(llm.generate([EXTENDED], GREEDY)[0].outputs[0].token_ids, refs[-1], "extending a cached prompt")
        assert llm.stats()["prefix_cache_hit_tokens"] >= hits + len(PROMPTS[1])  # the whole cached prompt reused
        for completion in llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, n=2))[0].outputs:
            _same(completion.token_ids, refs[3], "n=2")
        stats = llm.stats()
    assert stats["prefix_caching"] == ("whole prompts" if family in HYBRIDS else "prefixes")


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_family_refused_where_the_window_would_be_lost(zoo: Path, stories: str, family: str) -> None:
    path = _family(zoo, stories, family)
    with pytest.raises(UnsupportedError, match=rf"\({family}\) has sliding-window attention layers.*attn_implementation = \"auto\""):
        LLM(str(path), backend="hf", backends={"hf": {"attn_implementation": "eager"}})
    with pytest.raises(UnsupportedError, match=rf"offload.*\({family}\) has sliding-window attention layers"):
        LLM(str(path), backend="hf", offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0})


def test_hybrid_without_prefix_caching_and_partial_prefix(zoo: Path, stories: str) -> None:
    """A prompt sharing only part of a cached one computes from scratch (a recurrent state cannot be
    cut back); caching off says so in stats."""
    path = _family(zoo, stories, "bamba")
    if not _states_api():  # transformers 4.x: refused at load
        with pytest.raises(UnsupportedError, match=r"lacks 'recurrent_state'.*transformers>=5\.21"):
            LLM(str(path), backend="hf")
        return
    partial = PROMPTS[0][:20] + PROMPTS[2][1:9]
    refs = reference(path, [PROMPTS[0], partial], NEW)
    with LLM(str(path), backend="hf", kv_cache={"enable_prefix_caching": True}) as llm:
        _same(llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids, refs[0], "first")
        _same(llm.generate([partial], GREEDY)[0].outputs[0].token_ids, refs[1], "sharing 20 tokens")
        assert llm.stats()["prefix_cache_hit_tokens"] == 0 and llm.stats()["prefix_caching"] == "whole prompts"
    with LLM(str(path), backend="hf", kv_cache={"enable_prefix_caching": False}) as llm:
        _same(llm.generate([partial], GREEDY)[0].outputs[0].token_ids, refs[1], "caching off")
        assert llm.stats()["prefix_caching"] == "off"


@pytest.mark.parametrize(("installed", "lacks"), [("4.56.2", True), ("5.17.0", True), ("5.20.1", True), ("5.21.0", False), ("5.24.0", False)])
def test_recurrent_state_is_declared_only_where_transformers_serves_it_through_the_cache_api(monkeypatch: pytest.MonkeyPatch,
                                                                                             installed: str, lacks: bool) -> None:
    """Before 5.21 transformers' hybrid models read conv / recurrent states from the cache's layers
    directly (an IndexError at the first decode step on 5.17): lmdock-hf declares recurrent_state lacking
    there, so the loader refuses hybrids at load with the reason (read from metadata: nothing imported)."""
    import importlib.metadata

    import lmdock_hf

    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    found = lmdock_hf._states_api_lacking()
    assert ("recurrent_state" in found) is lacks, found
    if lacks:
        assert installed in found["recurrent_state"] and "transformers>=5.21" in found["recurrent_state"]
