"""lmdock-llamacpp's own tests, on the real llama.cpp and ../shared/models/stories260K-gguf.

The shared contract is lmdock-conformance; these check what is particular to this engine: the
llama.cpp sequence pool, batching rows at different positions, fork, the GGUF file handling and the
refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdock_llamacpp
import numpy as np
import pytest
from lmdock import LLM, BackendError, ModelConfig, SamplingParams, UnsupportedError
from lmdock.backend import SeqChunk
from lmdock_llamacpp import LlamaCppOptions

MODELS = Path(os.environ.get("LMDOCK_MODELS", Path(__file__).resolve().parents[4] / "shared" / "models"))
GGUF = MODELS / "stories260K-gguf" / "stories260K.gguf"
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" (../shared/models/README.md)
GREEDY_8 = [432, 383, 286, 261, 376, 298, 315, 421]


def make_engine(model: Path | str = GGUF, options: LlamaCppOptions | None = None, **config: Any) -> Any:
    from lmdock_llamacpp._engine import load

    mc = ModelConfig(model=str(model), backend="llamacpp", **config)
    build = lmdock_llamacpp.plugin.lmdock_translate_build_config(backend="llamacpp", model_config=mc)
    quant = None
    if mc.quantization.enabled:
        quant = lmdock_llamacpp.plugin.lmdock_translate_quantization(backend="llamacpp", quant=mc.quantization, model_config=mc)
    return load(mc, options or LlamaCppOptions(), quant, build)


@pytest.fixture(scope="module")
def engine() -> Any:
    assert GGUF.is_file(), f"{GGUF} is missing: set LMDOCK_MODELS to ../shared/models"
    eng = make_engine()
    yield eng
    eng.close()


def prefill(engine: Any, seq_id: int, ids: list[int]) -> np.ndarray:
    return engine.step([SeqChunk(seq_id, ids, 0)]).last[0]


def test_entry_module_is_light() -> None:
    code = "import sys, json, lmdock_llamacpp; print(json.dumps([m for m in ('llama_cpp', 'numpy', 'jinja2') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip()) == []


def test_probe_and_file_type(engine: Any) -> None:
    assert lmdock_llamacpp.SPEC.available() is None
    assert engine.file_type == "F32"
    assert engine.vocab_size == 512 and engine.eos_token_ids == (2,)


def test_tokenizer_is_the_ggufs_own(engine: Any) -> None:
    tok = engine.tokenizer
    assert tok.encode("Once upon a time") == PROMPT
    assert tok.encode("Once upon a time", add_special_tokens=False) == PROMPT[1:]
    assert tok.decode(PROMPT, skip_special_tokens=True).strip() == "Once upon a time"
    assert tok.decode([1]) == "<s>" and tok.decode([1], skip_special_tokens=True) == ""
    assert tok.encode("<s>Once", add_special_tokens=False)[0] == 1  # special tokens in text are parsed


def test_decode_never_emits_half_a_character(engine: Any) -> None:
    tok = engine.tokenizer
    ids = tok.encode("a中", add_special_tokens=False)  # "中" is three byte-fallback tokens here
    assert len(ids) == 4 and tok.decode(ids) == "a中"
    for cut in (2, 3):
        assert tok.decode(ids[:cut]).endswith("\ufffd")  # the core's detokenizer waits on this


def test_rows_at_different_positions_decode_in_one_batch(engine: Any) -> None:
    a, b = PROMPT, [1, 403]
    prefill(engine, 0, a)
    prefill(engine, 1, b)
    together = engine.step([SeqChunk(0, [432], len(a)), SeqChunk(1, [407], len(b))]).last
    engine.release(0)
    engine.release(1)
    alone_a = prefill(engine, 2, a + [432])
    alone_b = prefill(engine, 3, b + [407])
    engine.release(2)
    engine.release(3)
    np.testing.assert_allclose(together[0], alone_a, atol=1e-4)
    np.testing.assert_allclose(together[1], alone_b, atol=1e-4)
    assert int(np.argmax(together[0])) == GREEDY_8[1]
    assert engine.num_sequences() == 0


def test_all_logits_rows_and_prefill_with_decode(engine: Any) -> None:
    prefill(engine, 0, PROMPT)
    out = engine.step([SeqChunk(0, [432], len(PROMPT)), SeqChunk(1, PROMPT, 0, all_logits=True)])
    assert out.full[1].shape == (len(PROMPT), 512)
    np.testing.assert_allclose(out.full[1][-1], out.last[1])
    assert int(np.argmax(out.full[1][-1])) == GREEDY_8[0] and int(np.argmax(out.last[0])) == GREEDY_8[1]
    engine.release(0)
    engine.release(1)


def test_release_gives_llama_sequence_ids_back(engine: Any) -> None:
    for round_ in range(3):  # more sequences in total than the pool holds
        ids = [100 * round_ + i for i in range(engine.n_seq_max)]
        engine.step([SeqChunk(s, [1, 403], 0) for s in ids])
        assert engine.num_sequences() == engine.n_seq_max
        with pytest.raises(BackendError, match="n_seq_max"):
            engine.step([SeqChunk(999, [1], 0)])
        assert engine.num_sequences() == engine.n_seq_max  # the failed step took nothing
        for s in ids:
            engine.release(s)
        assert engine.num_sequences() == 0
    engine.release(12345)  # unknown: nothing to do


def test_fork_shares_the_prefix(engine: Any) -> None:
    prefill(engine, 0, PROMPT)
    assert engine.fork(0, 1, 3)
    assert not engine.fork(0, 1, 3)  # the destination exists already
    assert not engine.fork(77, 2, 1)  # no such source
    forked = engine.step([SeqChunk(1, PROMPT[3:], 3)]).last[0]
    fresh = prefill(engine, 2, PROMPT)
    np.testing.assert_allclose(forked, fresh, atol=1e-4)
    # the source is untouched by its fork
    np.testing.assert_allclose(engine.step([SeqChunk(0, [432], 5)]).last[0], engine.step([SeqChunk(2, [432], 5)]).last[0], atol=1e-4)
    for s in (0, 1, 2):
        engine.release(s)
    assert engine.num_sequences() == 0


def test_a_chunk_before_the_held_length_truncates(engine: Any) -> None:
    prefill(engine, 0, PROMPT + [432, 383])
    again = engine.step([SeqChunk(0, [432], 5)]).last[0]
    assert int(np.argmax(again)) == GREEDY_8[1]
    engine.release(0)


def test_generate_and_sequences_return_to_zero() -> None:
    with LLM(str(GGUF), backend="llamacpp") as llm:
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=8))[0]
        assert out.outputs[0].token_ids == GREEDY_8
        llm.generate(["The cat", "One day"], SamplingParams(n=3, temperature=1.0, seed=1, max_new_tokens=6))
        llm.generate([PROMPT], SamplingParams(beam_width=3, max_new_tokens=6))
        llm.clear_cache()  # the prefix caches hold KV state on purpose
        assert llm.engine.engine.num_sequences() == 0


def test_a_folder_holding_one_gguf(tmp_path: Path) -> None:
    (tmp_path / "stories260K.gguf").symlink_to(GGUF)
    eng = make_engine(tmp_path)
    try:
        assert int(np.argmax(prefill(eng, 0, PROMPT))) == GREEDY_8[0]
    finally:
        eng.close()
    (tmp_path / "other.gguf").symlink_to(GGUF)
    with pytest.raises(BackendError, match="several GGUF models"):
        make_engine(tmp_path)


def test_paths_that_are_not_gguf_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="holds no .gguf"):
        make_engine(tmp_path)
    with pytest.raises(BackendError, match="not a .gguf file"):
        make_engine(MODELS / "stories260K" / "config.json")
    with pytest.raises(BackendError, match="does not download"):
        make_engine("someone/some-model-GGUF")


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import llama_cpp as lc

    out = tmp_path_factory.mktemp("q8") / "stories260K-q8_0.gguf"
    params = lc.llama_model_quantize_default_params()
    params.ftype = lc.LLAMA_FTYPE_MOSTLY_Q8_0
    assert lc.llama_model_quantize(str(GGUF).encode(), str(out).encode(), params) == 0
    return out


def test_a_quantized_file_is_detected_and_accepted(q8_file: Path) -> None:
    from lmdock import QuantConfig

    eng = make_engine(q8_file, quantization=QuantConfig(algo="int8_weight_only", checkpoint_prequantized=True))
    try:
        assert eng.file_type == "Q8_0"
        assert int(np.argmax(prefill(eng, 0, PROMPT))) == GREEDY_8[0]
    finally:
        eng.close()


def test_quantizing_is_refused_with_the_command_to_run() -> None:
    from lmdock import QuantConfig

    with pytest.raises(UnsupportedError, match="int4_weight_only.*llama-quantize"):
        make_engine(quantization=QuantConfig(algo="int4_weight_only"))
    with pytest.raises(UnsupportedError, match="holds F32 weights.*llama-quantize"):
        make_engine(quantization=QuantConfig(algo="int8_weight_only", checkpoint_prequantized=True))


def test_configs_it_cannot_honour_are_refused() -> None:
    from lmdock import BuildConfig, KvCacheConfig

    with pytest.raises(UnsupportedError, match="build.dtype 'float16'"):
        make_engine(build=BuildConfig(dtype="float16"))
    with pytest.raises(UnsupportedError, match="fp8"):
        make_engine(kv_cache=KvCacheConfig(dtype="fp8"))
    with pytest.raises(UnsupportedError, match="tensor_parallel_size"):
        make_engine(build=BuildConfig(tensor_parallel_size=2))
    with pytest.raises(UnsupportedError, match="offload"):
        LLM(str(GGUF), backend="llamacpp", offload={"weights_gpu_percent": 0, "weights_cpu_percent": 100})
    with pytest.raises(ValueError, match="n_seq_max"):
        LlamaCppOptions(n_seq_max=1000)


def test_portable_configs_reach_llama_cpp() -> None:
    from lmdock import BuildConfig, KvCacheConfig, SchedulerConfig

    eng = make_engine(build=BuildConfig(max_seq_len=128), kv_cache=KvCacheConfig(dtype="float16", max_tokens=1024),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    try:
        assert eng.max_seq_len == 128
        assert eng.kv_capacity_tokens >= 1024 and eng.n_batch == 256 and eng.n_seq_max == 2 * 4 + 32
        assert int(np.argmax(prefill(eng, 0, PROMPT))) == GREEDY_8[0]  # f16 KV keeps the greedy choice here
    finally:
        eng.close()


def test_a_context_shorter_than_the_sequence_pool_runs() -> None:
    """llama.cpp caps n_batch at the n_ctx it is given, then pads n_ctx to 256: a 16-token context (a
    family capped at its window) under 40 sequences aborted the process in llama_init_from_model."""
    from lmdock import BuildConfig, SchedulerConfig

    eng = make_engine(build=BuildConfig(max_seq_len=16), scheduler=SchedulerConfig(max_num_seqs=4))
    try:
        assert eng.max_seq_len == 16 and eng.n_seq_max == 2 * 4 + 32 and eng.n_batch >= eng.n_seq_max
        assert int(np.argmax(prefill(eng, 0, PROMPT))) == GREEDY_8[0]
    finally:
        eng.close()


def test_an_n_batch_below_the_sequence_pool_is_refused_not_aborted() -> None:
    with pytest.raises(BackendError, match=r"n_batch = 8 is below n_seq_max = 16.*raise n_batch or lower n_seq_max"):
        LLM(str(GGUF), backend="llamacpp", backends={"llamacpp": {"n_batch": 8, "n_seq_max": 16}})


def test_backend_options_are_validated() -> None:
    with pytest.raises(Exception, match="n_thread"):
        LLM(str(GGUF), backend="llamacpp", backends={"llamacpp": {"n_thread": 2}})
    with LLM(str(GGUF), backend="llamacpp", backends={"llamacpp": {"n_threads": 1, "n_seq_max": 8, "type_k": "f16"}}) as llm:
        assert llm.engine.engine.n_seq_max == 8
        assert llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=3))[0].outputs[0].token_ids == GREEDY_8[:3]
