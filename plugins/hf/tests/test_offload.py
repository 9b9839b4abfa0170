"""OffloadPolicy on lmdock-hf: decoder layers streamed from lmdock's on-disk layout, whole batch per
layer (FlexLLMGen's block schedule).  The reference is lmdock-hf's in-memory path (itself checked
against transformers in test_hf.py): greedy tokens must be equal, as the weights are the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lmdock import LLM, SamplingParams

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
        from lmdock_hf._offload_layout import Layout

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


# -- compress_cache: the KV cache group-wise 4-bit ---------------------------------------------------
# stories260K has head_dim 8 (< 64), so a group is one head at one position: 4 bytes of codes and a
# float16 (min, scale) pair, 8 bytes against 32 in float32.

STREAMED_KV4 = {"weights_gpu_percent": 0, "weights_cpu_percent": 0, "compress_cache": True}
WITH_PROMPT_LP = SamplingParams(temperature=0, max_new_tokens=24, prompt_logprobs=0)


def _prompt_logprobs(outs: list[Any]) -> list[float]:
    return [o.prompt_logprobs[i][o.prompt_token_ids[i]].logprob for o in outs for i in range(1, len(o.prompt_token_ids))]


def _kv_bytes_per_position(cache: Any) -> float:
    """Bytes the cache's tensors hold per (slot, position): every layer, K and V, every KV head."""
    return sum(t.nbytes for t in cache.k + cache.v) / (cache.cap_slots * cache.cap_len)


def _fake_kv4(x: Any) -> Any:
    """What the 4-bit cache gives back, written out independently: min-max per group of head_dim
    values, 16 levels, min and scale rounded to float16 first."""
    import torch

    lo = x.amin(-1, keepdim=True)
    scale = ((x.amax(-1, keepdim=True) - lo) / 15).half().float()
    lo = lo.half().float()
    q = ((x - lo) / torch.where(scale > 0, scale, torch.ones_like(scale))).round().clamp(0, 15)
    return q * scale + lo


def test_compress_cache_keeps_prompt_logprobs_near_the_uncompressed_ones(stories: str) -> None:
    import numpy as np
    import torch

    with LLM(stories, backend="hf", offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0}) as llm:
        plain = llm.generate(PROMPTS, WITH_PROMPT_LP)
    with LLM(stories, backend="hf", offload=STREAMED_KV4) as llm:
        kv4 = llm.generate(PROMPTS, WITH_PROMPT_LP)
        cache = _engine(llm).cache
        assert {t.dtype for t in cache.k + cache.v} == {torch.uint8}
        assert _engine(llm).stats()["bytes_read"] > 0  # streamed layers and the 4-bit cache together
    assert all(len(o.outputs[0].token_ids) == 24 for o in kv4)
    diff = np.abs(np.array(_prompt_logprobs(kv4)) - np.array(_prompt_logprobs(plain)))
    # measured on these 20 positions: max 2.43 (one position of "Lily went to the park and"), mean
    # 0.20; stories260K (head_dim 8, hidden 64) is small enough for 4-bit K/V to move it that far
    # (transformers with the same K/V rounding agrees to 1e-4: the next test)
    assert diff.max() < 4.0 and diff.mean() < 0.4
    assert diff.max() > 0.05  # the 4-bit path was taken: not the full-precision numbers
    assert kv4[0].outputs[0].token_ids[:10] == plain[0].outputs[0].token_ids[:10]


def test_compress_cache_gives_transformers_logprobs_with_the_same_4bit_kv(stories: str) -> None:
    """Tight check of the plumbing (encode, slot writes, dequantizing the right range): the engine
    equals transformers whose attention sees K and V quantized and dequantized by ``_fake_kv4``."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    def attention(module: Any, q: Any, k: Any, v: Any, mask: Any, dropout: float = 0.0, scaling: Any = None, **kw: Any) -> Any:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, _fake_kv4(k), _fake_kv4(v), attn_mask=mask, is_causal=mask is None and q.shape[2] > 1, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("lmdock_test_kv4", attention)
    ref = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32, attn_implementation="lmdock_test_kv4").eval()
    with LLM(stories, backend="hf", offload={"compress_cache": True}) as llm:  # layers resident, only the KV is 4-bit
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0))
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            want = torch.log_softmax(ref(ids).logits[0].float(), -1)
        got = [o.prompt_logprobs[i][int(ids[0, i])].logprob for i in range(1, ids.shape[1])]
        # measured: equal to the bit.  The bound leaves room for a value that another CPU's matmul
        # puts across a rounding boundary (~2e-3); a slot, range or scale error moves it by more than
        # 0.1 (rounding min/scale to float16 after quantizing instead of before alone gives 0.28)
        assert got == pytest.approx([float(want[i - 1, ids[0, i]]) for i in range(1, ids.shape[1])], abs=5e-3)


def test_compress_cache_holds_a_quarter_of_the_kv_bytes(stories: str) -> None:
    import torch
    from lmdock_hf._offload_kv import kv_bytes_per_token

    with LLM(stories, backend="hf") as llm:  # the in-memory engine's float32 slot cache
        llm.generate(PROMPTS, GREEDY)
        plain = _kv_bytes_per_position(_engine(llm).cache)
    with LLM(stories, backend="hf", offload={"compress_cache": True}) as llm:
        llm.generate(PROMPTS, GREEDY)
        cache = _engine(llm).cache
        kv4 = _kv_bytes_per_position(cache)
        assert (cache.head_dim, cache.group, cache.row_bytes) == (8, 8, 8)
        assert {(t.dtype, t.shape[1], t.shape[3]) for t in cache.k + cache.v} == {(torch.uint8, 4, 8)}
    # 5 layers x K,V x 4 KV heads x (8 float32 = 32 bytes | 4 code bytes + float16 min, scale = 8 bytes)
    assert plain == 5 * 2 * 4 * 32 == kv_bytes_per_token(5, 4, 8, 4, None)
    assert kv4 == 5 * 2 * 4 * 8 == kv_bytes_per_token(5, 4, 8, 4, 8)
    assert plain / kv4 == 4.0


def test_compress_cache_pack_round_trip_and_groups() -> None:
    import torch
    from lmdock import UnsupportedError
    from lmdock_hf._offload_kv import CompressedSlotKVCache, kv_group

    assert [kv_group(hd, 64) for hd in (8, 64, 128, 96, 80)] == [8, 64, 64, 48, 40]
    with pytest.raises(UnsupportedError, match="even head_dim"):
        kv_group(7, 64)
    gen = torch.Generator().manual_seed(0)
    for head_dim, group, dtype in [(8, 8, torch.float32), (128, 64, torch.bfloat16)]:
        cache = CompressedSlotKVCache(torch.device("cpu"), dtype, 64, head_dim, group)
        x = (torch.randn((3, 2, 5, head_dim), generator=gen) * 4).to(dtype)
        rows = cache.encode(x)
        assert rows.dtype == torch.uint8 and rows.shape == (3, 2, 5, head_dim // 2 + head_dim // group * 4)
        y = cache.decode(rows, dtype)
        g = x.float().unflatten(-1, (-1, group))
        half_step = ((g.amax(-1) - g.amin(-1)) / 30)[..., None]  # half a quantization step, per group
        err = (y.float() - x.float()).unflatten(-1, (-1, group)).abs()
        assert bool((err <= half_step * 1.01 + 1e-2).all())
        assert y.dtype == dtype and not torch.equal(y, x)
    cache = CompressedSlotKVCache(torch.device("cpu"), torch.float32, 64, 8, 8)
    c = torch.full((1, 1, 1, 8), 0.75)  # a constant group (scale 0) comes back exactly
    assert torch.equal(cache.decode(cache.encode(c), torch.float32), c)


def test_cost_model_fits_a_larger_batch_with_compress_cache(stories: str) -> None:
    """Same memory_budget_gib: KV at a quarter of the bytes per token lets the plan take ~4x the batch."""
    batch = {}
    for kv4 in (False, True):
        policy = {"memory_budget_gib": 0.005, "compress_cache": kv4}
        with LLM(stories, backend="hf", offload=policy, scheduler={"max_num_seqs": 256}) as llm:
            engine = _engine(llm)
            batch[kv4] = engine.scheduler_limits["max_num_seqs"]
            assert ("(4-bit, compress_cache)" in engine.offload_plan) == kv4
            if kv4:
                assert all(len(o.outputs[0].token_ids) == 24 for o in llm.generate(PROMPTS, GREEDY))
    # measured: 7 sequences of 512 tokens (0.62 MiB of KV each) against 29 (0.16 MiB each)
    assert batch[True] >= 3 * batch[False] and batch[True] < 256  # the budget chose, not max_num_seqs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compress_cache_batched_decode_with_releases_matches_each_sequence_alone(stories: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows at different lengths decode together; short ones finish first and release their slots in
    the middle (the last slot moves into the hole); each sequence still gets the tokens it gets alone.

    In float32 the batched and single-row matmuls differ in the last bits of K/V, and now and then
    that moves a value across a 4-bit rounding boundary: logprobs then differ by ~1e-3 (measured
    2.3e-3 here; 3e-6 without compress_cache) and, rarely, a later token does.  In float64 (not a
    dtype lmdock-hf offers; patched in) those last bits never reach a boundary, so the 4-bit path
    itself must be exact per sequence: bit-equal logprobs."""
    if dtype == "float64":
        import torch
        from lmdock_hf import _offload

        monkeypatch.setattr(_offload, "_dtype", lambda name, device: torch.float64)
        monkeypatch.setitem(_offload.TORCH_DTYPES, "float64", torch.float64)
    prompts = PROMPTS + ["Tom had a big red ball. He liked to", "Mom said"]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, logprobs=0) for n in (24, 4, 20, 9, 16, 2)]
    with LLM(stories, backend="hf", offload={"compress_cache": True}, kv_cache={"enable_prefix_caching": False}) as llm:
        assert str(_engine(llm).dtype) == f"torch.{dtype}"
        alone = [llm.generate(p, sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    # prefix caching off here too: its forks would take the last slots, and moving one of those into
    # a hole would not show in any output
    with LLM(stories, backend="hf", offload=STREAMED_KV4, kv_cache={"enable_prefix_caching": False}) as llm:
        engine = _engine(llm)
        cache, moved = engine.cache, []
        release = cache.release

        def spy(seq_id: int) -> None:  # did the release leave a hole that the last slot fills?
            moved.append(cache.slot_of.get(seq_id, len(cache)) < len(cache) - 1)
            release(seq_id)

        cache.release = spy
        together = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert engine.num_sequences() == 0
    assert any(moved)
    assert [list(o.token_ids) for o in together] == [list(o.token_ids) for o in alone]
    for a, b in zip(alone, together):
        lp_a = [p[t].logprob for p, t in zip(a.logprobs, a.token_ids)]
        lp_b = [p[t].logprob for p, t in zip(b.logprobs, b.token_ids)]
        assert lp_b == (lp_a if dtype == "float64" else pytest.approx(lp_a, abs=1e-2))


def test_compress_cache_prefix_hits_copy_codes_and_scales(stories: str) -> None:
    """Automatic prefix caching forks a cached prompt's 4-bit rows (``copy``) into a new sequence:
    the result equals computing the whole prompt."""
    short = "Once upon a time, there was a little girl"
    longer = short + " named Lily. She liked to"
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=0)
    with LLM(stories, backend="hf", offload={"compress_cache": True}, kv_cache={"enable_prefix_caching": False}) as llm:
        want = llm.generate(longer, params)[0].outputs[0]
    with LLM(stories, backend="hf", offload={"compress_cache": True}) as llm:
        llm.generate(short, params)
        got = llm.generate(longer, params)[0].outputs[0]
        assert llm.engine.stats()["prefix_cache_hit_tokens"] > 5
    assert list(got.token_ids) == list(want.token_ids)
    # measured: equal within 1e-6; the bound allows a rounding-boundary flip (see above)
    assert [p[t].logprob for p, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
        [p[t].logprob for p, t in zip(want.logprobs, want.token_ids)], abs=1e-2)


@pytest.mark.parametrize(("prefill_tokens", "groups"), [(None, [4]), (12, [2, 2]), (6, [1, 1, 1, 1])])
def test_prompts_of_one_length_prefill_together_and_match_in_memory(stories: str, monkeypatch: pytest.MonkeyPatch, prefill_tokens: int | None, groups: list[int]) -> None:
    """Equal-width prefill chunks pass through each layer as one group (not one forward per prompt),
    at most ``prefill_tokens`` tokens a group, each row's KV written to its own slot: tokens and
    logprobs as in memory."""
    from lmdock_hf import _offload

    prompts = [[1, 403, 407, 261, 378, 300], [1, 9, 37, 120, 61, 2], [1, 400, 17, 99, 3, 5], [1, 7, 7, 7, 7, 7]]
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=0, ignore_eos=True)
    with LLM(stories, backend="hf", kv_cache={"enable_prefix_caching": False}) as ref:
        want = ref.generate(prompts, params)
    rows: list[int] = []
    real = _offload._Group.__init__

    def spy(self: Any, engine: Any, chunks: list, all_logits: bool) -> None:
        if len(chunks[0].token_ids) > 1:
            rows.append(len(chunks))
        real(self, engine, chunks, all_logits)

    monkeypatch.setattr(_offload._Group, "__init__", spy)
    with LLM(stories, backend="hf", kv_cache={"enable_prefix_caching": False}, offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0}) as llm:
        engine = _engine(llm)
        assert engine.prefill_tokens == engine.MIN_PREFILL_TOKENS  # stories260K's layers are tiny
        if prefill_tokens:
            engine.prefill_tokens = prefill_tokens
        got = llm.generate(prompts, params)
    assert rows == groups
    for w, g in zip(want, got):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            (ta, la), = a.items()
            assert abs(la.logprob - b[ta].logprob) < 1e-4


def test_kv_cache_grows_by_an_eighth_into_mappings_of_its_own() -> None:
    """The offload engine's slot cache: slots grow to a multiple of 8 by at least an eighth (66 live
    sequences take 72 slots, not doubling's 128), and on the CPU each K/V tensor is a mapping of its
    own, freed with it, not malloc'ed heap that a growth leaves behind."""
    import torch
    from lmdock_hf._offload_kv import HostSlotKVCache

    cache = HostSlotKVCache(torch.device("cpu"), torch.float32, 40)
    sizes = []
    for seq in range(66):
        cache.slot(seq)
        cache.reserve(len(cache), 8)
        if not sizes or sizes[-1] != cache.cap_slots:
            sizes.append(cache.cap_slots)
    assert sizes == [8, 16, 24, 32, 40, 48, 56, 64, 72]
    k, _v = cache.layer(0, torch.zeros(1, 2, 8, 4))
    assert k.shape == (72, 2, 40, 4) and not k.any()
    k[5, 1, 3] = 1.0
    cache.reserve(80, 8)
    assert cache.k[0][5, 1, 3].tolist() == [1.0] * 4 and cache.k[0].shape[0] == 88  # kept across the growth


@pytest.mark.parametrize(("threads", "request_bytes"), [(1, 1 << 30), (4, 8192), (3, 4 << 20)])
def test_direct_reader_parts_land_in_place(tmp_path: Path, threads: int, request_bytes: int) -> None:
    """The layer reader splits a file into aligned parts read by several threads into one buffer:
    every byte lands where a single read would put it (O_DIRECT, or buffered where refused)."""
    import mmap
    import os

    from lmdock_hf._direct import DirectReader, ShortFile

    data = os.urandom(4096 * 10)  # ten pages: parts of 3, 3, 3 and 1 pages with 4 threads
    (tmp_path / "f.bin").write_bytes(data)
    buf = mmap.mmap(-1, len(data))
    reader = DirectReader(threads=threads, request=request_bytes)
    try:
        assert reader.read(str(tmp_path / "f.bin"), memoryview(buf)) == len(data)
        assert bytes(buf) == data
        big = mmap.mmap(-1, len(data) + 4096)
        with pytest.raises(ShortFile):
            reader.read(str(tmp_path / "f.bin"), memoryview(big))
    finally:
        reader.close()
