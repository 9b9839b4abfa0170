"""OffloadPolicy on lmdock-hf: decoder layers streamed from lmdock's on-disk layout, whole batch per
layer (FlexLLMGen's block schedule).  The reference is lmdock-hf's in-memory path (itself checked
against transformers in test_hf.py): greedy tokens must be equal, as the weights are the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lmdock import LLM, LmdockError, SamplingParams

PROMPTS = ["Once upon a time", "The cat sat", "Lily went to the park and", "One day"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def in_memory(stories: str) -> list[list[int]]:
    with LLM(stories, backend="hf") as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.getbasetemp() / "lmdock-cache"
    monkeypatch.setenv("LMDOCK_CACHE_DIR", str(root))
    return root


def _engine(llm: Any) -> Any:
    return llm._engine.engine


@pytest.mark.parametrize("policy", [
    {"weights_gpu_percent": 0, "weights_cpu_percent": 0},  # every layer streamed, prefetch on
    {"weights_gpu_percent": 0, "weights_cpu_percent": 0, "prefetch": False},
    {"weights_gpu_percent": 0, "weights_cpu_percent": 50},  # half resident, half streamed
])
def test_streamed_layers_give_the_in_memory_greedy_tokens(stories: str, in_memory: list[list[int]], cache_dir: Path, policy: dict) -> None:
    with LLM(stories, backend="hf", offload=policy) as llm:
        out = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        engine = _engine(llm)
        stats = engine.stats()
        llm.clear_cache()  # the prefix caches hold KV state on purpose
        assert engine.num_sequences() == 0
    assert out == in_memory
    assert stats["bytes_read"] > 0  # the layers really came from disk
    assert list(cache_dir.glob("hf-offload/*/manifest.json")), "the layout is cached under LMDOCK_CACHE_DIR"


def test_compress_weight_streams_fewer_bytes_and_still_generates(stories: str, cache_dir: Path) -> None:
    with LLM(stories, backend="hf", offload={"weights_gpu_percent": 0, "compress_weight": True}) as llm:
        out = llm.generate(PROMPTS, GREEDY)
        layout = _engine(llm).layout
    plain = [f for f in cache_dir.glob("hf-offload/*/manifest.json") if f.parent != layout.folder]
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    if plain:  # a full-precision layout of the same model from an earlier test: 4-bit is much smaller
        from lmdock_hf._offload import Layout

        def payload(lay: Layout) -> int:  # bytes of values and group scales, without the 4 KiB alignment
            return sum(e.nbytes + (e.numel() // lay.group * 4 if e.compressed else 0) for e in lay.entries)

        assert payload(layout) * 2 < payload(Layout(plain[0].parent))


def test_memory_budget_picks_placement_and_batch_and_says_so(stories: str, in_memory: list[list[int]]) -> None:
    with LLM(stories, backend="hf", offload={"memory_budget_gib": 0.01, "batch_size": 2}) as llm:
        out = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        engine = _engine(llm)
        assert "Chosen from memory_budget_gib=0.01" in engine.offload_plan
        assert engine.scheduler_limits == {"max_num_seqs": 2}
    assert out == in_memory


def test_compress_cache_is_refused_by_name(stories: str) -> None:
    with pytest.raises(LmdockError, match="compress_cache"):
        LLM(stories, backend="hf", offload={"weights_gpu_percent": 0, "compress_cache": True})
