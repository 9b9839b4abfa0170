"""lmdock_hf._cache: the one object transformers sees of lmdock-hf's KV state (issue 26).

transformers 5.24 started calling ``cache.update(key, value, layer_idx, kwargs=kwargs)`` and renamed
the forward's ``past_key_values`` to ``cache``; a view with a signature of its own broke every hf
path.  These tests call the adapter the way each supported release does, and run the installed
transformers with its deprecation warnings as errors, so the release that deprecates what lmdock-hf
uses fails here before the one that removes it fails users.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
from lmdock import LLM, SamplingParams
from lmdock.backend import SeqChunk
from lmdock_hf._cache import BatchView, SlotKVCache, cache_keyword
from stories_facts import GREEDY_40, PROMPT_IDS
from transformers.cache_utils import Cache

HEADS, DIM = 2, 8


def _view(cache: SlotKVCache, slots: list[int], starts: list[int], width: int) -> BatchView:
    for s in slots:
        cache.slot(s)
    cache.reserve(len(cache), max(starts) + width)
    return BatchView(cache, [cache.slot_of[s] for s in slots], starts, width, max(starts) + width)


def _kv(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HEADS, width, DIM, generator=g), torch.randn(rows, HEADS, width, DIM, generator=g)


def test_the_view_is_a_transformers_cache() -> None:
    view = _view(SlotKVCache(torch.device("cpu"), torch.float32, 64), [0], [0], 3)
    assert isinstance(view, Cache)
    assert view.get_seq_length() == 0 and view.get_mask_sizes(3, 0) == (3, 0)
    assert view.is_compileable is False


@pytest.mark.parametrize("call", ["4.56: cache_kwargs positional", "5.24: kwargs=", "no extras"])
def test_update_takes_every_releases_calling_convention(call: str) -> None:
    cache = SlotKVCache(torch.device("cpu"), torch.float32, 64)
    k, v = _kv(1, 4, seed=1)
    view = _view(cache, [7], [0], 4)
    extra: tuple[Any, ...] = ()
    kw: dict[str, Any] = {}
    if call.startswith("4.56"):
        extra = ({"cache_position": torch.arange(4)},)
    elif call.startswith("5.24"):
        kw = {"kwargs": {"position_ids": torch.arange(4)[None]}}
    K, V = view.update(k, v, 0, *extra, **kw)
    assert torch.equal(K, k) and torch.equal(V, v)
    # the next decode step of the same sequence sees all five positions
    k1, v1 = _kv(1, 1, seed=2)
    K, V = _view(cache, [7], [4], 1).update(k1, v1, 0, *extra, **kw)
    assert torch.equal(K, torch.cat([k, k1], dim=2)) and torch.equal(V, torch.cat([v, v1], dim=2))


def test_a_packed_cache_stores_codes_and_returns_the_models_dtype() -> None:
    from lmdock_hf._offload import CompressedSlotKVCache

    cache = CompressedSlotKVCache(torch.device("cpu"), torch.float32, 64, DIM, DIM)
    k, v = _kv(1, 3, seed=3)
    K, V = _view(cache, [1], [0], 3).update(k, v, 0, kwargs={})
    assert cache.k[0].dtype == torch.uint8 and K.dtype == torch.float32
    assert (K - k).abs().max() < 0.2 and (V - v).abs().max() < 0.2


def test_the_cache_keyword_is_the_one_the_installed_forward_takes(stories: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32)
    kw = cache_keyword(model)
    assert kw in ("cache", "past_key_values") and kw in inspect.signature(model.forward).parameters


def test_the_step_engine_and_offload_run_without_transformers_deprecation_warnings(stories: str) -> None:
    """What transformers deprecates today it removes in a later release: fail on the warning."""
    for options in ({}, {"offload": {"weights_gpu_percent": 0, "weights_cpu_percent": 0}}):
        with LLM(stories, backend="hf", **options) as llm:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                warnings.simplefilter("error", DeprecationWarning)
                out = llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_new_tokens=len(GREEDY_40)))
            assert out[0].outputs[0].token_ids == GREEDY_40, options


def test_engine_steps_through_the_view_match_a_plain_forward(stories: str) -> None:
    """A prefill then a decode step through BatchView give transformers' own float32 logits."""
    from lmdock_hf._engine import HFStepEngine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([PROMPT_IDS])).logits[0].float().numpy()
    eng = HFStepEngine(model, AutoTokenizer.from_pretrained(stories), torch.device("cpu"), 256, None, {})
    first = eng.step([SeqChunk(seq_id=1, token_ids=PROMPT_IDS[:-1], start=0)])
    second = eng.step([SeqChunk(seq_id=1, token_ids=PROMPT_IDS[-1:], start=len(PROMPT_IDS) - 1)])
    assert abs(first.last[0] - ref[-2]).max() < 1e-4
    assert abs(second.last[0] - ref[-1]).max() < 1e-4


def test_released_slots_are_given_back_and_the_live_ones_kept() -> None:
    """A burst grows the slots (n=512 kept 512 slots of KV for the life of the process: issue 28);
    once a quarter or fewer are in use they halve, and the live sequences keep their KV."""
    cache = SlotKVCache(torch.device("cpu"), torch.float32, 64)
    for seq in range(64):
        cache.slot(seq)
    cache.reserve(64, 16)
    k, v = cache.layer(0, torch.zeros(1, 2, 1, 4))
    for seq in range(64):
        k[cache.slot_of[seq]] = seq
        v[cache.slot_of[seq]] = -seq
    assert cache.cap_slots == 64
    for seq in range(3, 64):
        cache.release(seq)
    assert cache.cap_slots == 8 and tuple(cache.k[0].shape) == (8, 2, 64, 4)  # 3 live: halved while 3 x 4 <= slots
    for seq in range(3):
        assert bool((cache.k[0][cache.slot_of[seq]] == seq).all()) and bool((cache.v[0][cache.slot_of[seq]] == -seq).all())
    cache.reserve(16, 16)  # a new burst grows them again
    assert cache.cap_slots == 16
