"""lmdock's portable types -> TensorRT-LLM LLM API keyword arguments.

Two API generations exist (``docs/backends/trtllm.md``):

* ``current``: PyTorch backend only.  ``LLM(**kwargs)`` validates every keyword against
  ``TorchLlmArgs`` (unknown ones are a ValueError); ``build_config`` and ``quant_config`` are gone:
  quantization comes from a pre-quantized checkpoint, KV-cache quantization from
  ``KvCacheConfig.dtype``.
* ``legacy``: releases that still build TensorRT engines take ``build_config=BuildConfig(...)`` and
  ``quant_config=QuantConfig(quant_algo=QuantAlgo.X)`` (the API of the seed documentation).

Everything here is pure: no ``tensorrt_llm`` import.  What TensorRT-LLM cannot do raises
:class:`lmdock.UnsupportedError` naming the setting and what to do instead.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from lmdock import ModelConfig, QuantConfig, SamplingParams, UnsupportedError

from lmdock_trtllm._refs import ConfigRef, EnumRef, TensorRef

Api = Literal["current", "legacy"]

#: TensorRT-LLM's limit on top-k logprobs (MAX_TOP_LOGPROBS).
MAX_LOGPROBS = 100

#: lmdock QuantConfig.algo -> QuantAlgo member on the legacy API.
LEGACY_QUANT_ALGOS = {
    "int8_weight_only": "W8A16",
    "int4_weight_only": "W4A16",
    "awq": "W4A16_AWQ",
    "gptq": "W4A16_GPTQ",
    "fp8": "FP8",
}
#: lmdock KvCacheConfig.dtype -> KvCacheConfig.dtype on the current API.
CURRENT_KV_DTYPES = {"auto": "auto", "fp8": "fp8", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}
#: lmdock KvCacheConfig.dtype -> QuantConfig.kv_cache_quant_algo on the legacy API.
LEGACY_KV_QUANT = {"fp8": "FP8", "int8": "INT8"}
#: lmdock scheduler policies -> (CapacitySchedulerPolicy, WaitingQueuePolicy) members.
SCHEDULER_POLICIES = {
    "fcfs": ("GUARANTEED_NO_EVICT", "FCFS"),
    "max_utilization": ("MAX_UTILIZATION", "FCFS"),
    "priority": ("GUARANTEED_NO_EVICT", "PRIORITY"),
    "static_batch": ("STATIC_BATCH", "FCFS"),
}


# -------------------------------------------------------------------------------------------------
# quantization
# -------------------------------------------------------------------------------------------------


def quant_config(quant: QuantConfig, kv_dtype: str, api: Api) -> ConfigRef | None:
    """The ``quant_config`` keyword (legacy API only); None when nothing is quantized."""
    if api == "current":
        if quant.enabled and not quant.checkpoint_prequantized:
            raise UnsupportedError(
                f"quantization {quant.algo!r}: this TensorRT-LLM (PyTorch backend) quantizes only through the "
                "checkpoint. Quantize with NVIDIA ModelOpt and set quantization.checkpoint_prequantized = true, "
                "or use a TensorRT-LLM release that still takes quant_config (<= 1.2)."
            )
        return None
    kwargs: dict[str, Any] = {}
    if quant.enabled and not quant.checkpoint_prequantized:
        if quant.algo not in LEGACY_QUANT_ALGOS:
            raise UnsupportedError(
                f"quantization {quant.algo!r} has no TensorRT-LLM QuantAlgo; choose one of {', '.join(sorted(LEGACY_QUANT_ALGOS))}"
            )
        kwargs["quant_algo"] = EnumRef("QuantAlgo", LEGACY_QUANT_ALGOS[quant.algo])
        if quant.group_size is not None:
            kwargs["group_size"] = quant.group_size
    if kv_dtype in LEGACY_KV_QUANT:
        kwargs["kv_cache_quant_algo"] = EnumRef("QuantAlgo", LEGACY_KV_QUANT[kv_dtype])
    return ConfigRef("QuantConfig", kwargs) if kwargs else None


# -------------------------------------------------------------------------------------------------
# KV cache, scheduler, build limits
# -------------------------------------------------------------------------------------------------


def kv_cache_config(mc: ModelConfig, api: Api) -> ConfigRef:
    kv = mc.kv_cache
    kwargs: dict[str, Any] = {"enable_block_reuse": kv.enable_prefix_caching}
    if kv.memory_fraction is not None:
        kwargs["free_gpu_memory_fraction"] = kv.memory_fraction
    if kv.max_tokens is not None:
        kwargs["max_tokens"] = kv.max_tokens
    if kv.cpu_space_gib is not None:
        kwargs["host_cache_size"] = int(kv.cpu_space_gib * 2**30)
    if api == "current":
        if kv.dtype not in CURRENT_KV_DTYPES:
            raise UnsupportedError(f"kv_cache.dtype {kv.dtype!r}: TensorRT-LLM's KV cache takes {', '.join(CURRENT_KV_DTYPES)}")
        kwargs["dtype"] = CURRENT_KV_DTYPES[kv.dtype]
    elif kv.dtype not in ("auto", *LEGACY_KV_QUANT):
        raise UnsupportedError(f"kv_cache.dtype {kv.dtype!r}: TensorRT engines keep the model dtype; use auto, fp8 or int8")
    return ConfigRef("KvCacheConfig", kwargs)


def scheduler_config(mc: ModelConfig) -> ConfigRef:
    policy = mc.scheduler.policy
    if policy not in SCHEDULER_POLICIES:
        raise UnsupportedError(f"scheduler.policy {policy!r}: TensorRT-LLM schedules with {', '.join(SCHEDULER_POLICIES)}")
    capacity, waiting = SCHEDULER_POLICIES[policy]
    return ConfigRef(
        "SchedulerConfig",
        {"capacity_scheduler_policy": EnumRef("CapacitySchedulerPolicy", capacity), "waiting_queue_policy": EnumRef("WaitingQueuePolicy", waiting)},
    )


def _limits(mc: ModelConfig) -> dict[str, Any]:
    b = mc.build
    limits: dict[str, Any] = {"max_batch_size": b.max_batch_size or mc.scheduler.max_num_seqs, "max_beam_width": b.max_beam_width}
    limits["max_num_tokens"] = b.max_num_tokens or mc.scheduler.max_num_batched_tokens
    if b.max_seq_len is not None:
        limits["max_seq_len"] = b.max_seq_len
    return limits


def llm_kwargs(mc: ModelConfig, api: Api, *, skip_tokenizer_init: bool = False, enable_chunked_prefill: bool = True,
               guided_decoding_backend: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM(**kwargs)``."""
    b = mc.build
    if b.device not in ("auto", "cuda") and not b.device.startswith("cuda:"):
        raise UnsupportedError(f"build.device {b.device!r}: TensorRT-LLM runs on NVIDIA GPUs only")
    kwargs: dict[str, Any] = {"model": mc.model, "dtype": b.dtype, "trust_remote_code": mc.trust_remote_code}
    if mc.tokenizer:
        kwargs["tokenizer"] = mc.tokenizer
    if mc.revision:
        kwargs["revision"] = mc.revision
    if skip_tokenizer_init:
        kwargs["skip_tokenizer_init"] = True
    kwargs["tensor_parallel_size"] = b.tensor_parallel_size
    kwargs["pipeline_parallel_size"] = b.pipeline_parallel_size
    if b.distributed_executor == "ray":
        if api == "legacy":
            raise UnsupportedError("build.distributed_executor 'ray': TensorRT-LLM's Ray orchestrator needs the current (PyTorch) API")
        kwargs["orchestrator_type"] = "ray"
    kwargs["kv_cache_config"] = kv_cache_config(mc, api)
    kwargs["scheduler_config"] = scheduler_config(mc)
    kwargs["enable_chunked_prefill"] = enable_chunked_prefill
    if guided_decoding_backend is not None:
        if api == "legacy":
            raise UnsupportedError("guided_decoding_backend: structured output needs the current (PyTorch) TensorRT-LLM API")
        kwargs["guided_decoding_backend"] = guided_decoding_backend
    refuse_speculative(mc)
    limits = _limits(mc)
    if api == "current":
        kwargs.update(limits)
        quant_config(mc.quantization, mc.kv_cache.dtype, api)  # raises for what the API cannot do
    else:
        kwargs["build_config"] = ConfigRef("BuildConfig", limits)
        quant = quant_config(mc.quantization, mc.kv_cache.dtype, api)
        if quant is not None:
            kwargs["quant_config"] = quant
    kwargs.update(extra or {})
    return kwargs


def refuse_speculative(mc: ModelConfig) -> None:
    """``[models.NAME.speculative]`` (issue 42) is refused: the API contract this plugin is tested
    against (../shared/api-contracts) records ``LLM(speculative_config=...)`` only as a union
    "discriminated on 'decoding_type'", with none of its members (n-gram, draft-target...) or their
    fields, so a translation could not be checked and might be silently wrong."""
    method = getattr(getattr(mc, "speculative", None), "method", None)
    if method not in (None, "none"):
        raise UnsupportedError(
            f"speculative.method {method!r}: lmdock-trtllm does not translate [speculative] (the TensorRT-LLM API it is "
            "tested against records speculative_config's members without their fields); pass TensorRT-LLM's own "
            "config instead: backends.trtllm.llm_args = {speculative_config = {decoding_type = \"NGram\", ...}}"
        )


# -------------------------------------------------------------------------------------------------
# sampling
# -------------------------------------------------------------------------------------------------


def sampling_kwargs(p: SamplingParams, *, prompt_len: int, max_seq_len: int | None, guided_backend: str | None = None,
                    vocab_size: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.SamplingParams(**kwargs)`` for one request.

    ``guided_backend`` is the LLM's ``guided_decoding_backend``, which structured output needs;
    ``vocab_size`` (the model's logits width) is what ``logit_bias`` and ``allowed_token_ids`` need.
    """
    kwargs: dict[str, Any] = {}
    if p.max_new_tokens is not None:
        kwargs["max_tokens"] = p.max_new_tokens
    elif max_seq_len is not None:
        kwargs["max_tokens"] = max(1, max_seq_len - prompt_len)
    if p.beam_width > 1:
        # TensorRT-LLM has no beam_width: the switch is use_beam_search, the width is best_of.
        kwargs.update(use_beam_search=True, best_of=p.beam_width, n=p.n, length_penalty=p.length_penalty)
        kwargs["early_stopping"] = 1 if p.early_stopping else 0
    else:
        if p.n > 1 and p.greedy:
            raise UnsupportedError("n > 1 with greedy decoding gives n identical outputs and TensorRT-LLM refuses it; set temperature > 0")
        kwargs.update(n=p.n, **_sampling(p))
    _penalties(p, prompt_len, kwargs)
    if p.min_new_tokens:
        kwargs["min_tokens"] = p.min_new_tokens
    if p.seed is not None:
        kwargs["seed"] = p.seed
    if p.stop:
        kwargs["stop"] = list(p.stop)
        kwargs["include_stop_str_in_output"] = p.include_stop_str_in_output
    if p.stop_token_ids:
        kwargs["stop_token_ids"] = list(p.stop_token_ids)
    kwargs.update(ignore_eos=p.ignore_eos, detokenize=p.detokenize, skip_special_tokens=p.skip_special_tokens)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None:
            if k > MAX_LOGPROBS:
                raise UnsupportedError(f"{name}={k}: TensorRT-LLM returns at most {MAX_LOGPROBS} logprobs per token")
            kwargs[name] = k
    if p.logprobs is not None:
        kwargs["logprobs_mode"] = EnumRef("LogprobMode", "RAW")  # lmdock's logprobs are the raw model's
    if p.structured_output is not None:
        kwargs["guided_decoding"] = guided_decoding(p, guided_backend)
    if p.biased:
        kwargs.update(token_biases(p, vocab_size))
    return kwargs


def token_biases(p: SamplingParams, vocab_size: int | None) -> dict[str, Any]:
    """``logit_bias`` -> ``embedding_bias`` (one value per token), ``allowed_token_ids`` -> every
    other token in ``bad_token_ids``, ``bad_words`` -> ``bad``: each word as written and after a
    space (TensorRT-LLM tokenizes them; vLLM keeps the second form only where it gives another
    word-initial token of the same length, so here a word can be banned in one more spelling)."""
    if p.beam_width > 1:
        given = [n for n in ("logit_bias", "allowed_token_ids", "bad_words") if getattr(p, n) not in ({}, None, ())]
        raise UnsupportedError(f"{', '.join(given)} with beam search: lmdock's beam search ranks the model's own logprobs; "
                               "remove them, or sample without beam_width")
    out: dict[str, Any] = {}
    if p.logit_bias or p.allowed_token_ids is not None:
        if vocab_size is None:
            raise UnsupportedError("logit_bias / allowed_token_ids: the model's vocab_size is unknown (no config.json), "
                                   "which TensorRT-LLM's embedding_bias and bad_token_ids need")
        bad = next((t for t in [*p.logit_bias, *(p.allowed_token_ids or ())] if t >= vocab_size), None)
        if bad is not None:
            raise UnsupportedError(f"token id {bad} (logit_bias / allowed_token_ids) is outside the vocabulary [0, {vocab_size})")
    if p.logit_bias:
        out["embedding_bias"] = TensorRef(tuple(p.logit_bias.get(t, 0.0) for t in range(vocab_size)))  # type: ignore[arg-type]
    if p.allowed_token_ids is not None:
        allowed = set(p.allowed_token_ids)
        out["bad_token_ids"] = [t for t in range(vocab_size) if t not in allowed]  # type: ignore[arg-type]
    if p.bad_words:
        out["bad"] = [form for w in p.bad_words for form in (w.lstrip(), " " + w.lstrip())]
    return out


def guided_decoding(p: SamplingParams, guided_backend: str | None) -> ConfigRef:
    """``SamplingParams.structured_output`` -> ``GuidedDecodingParams`` (a choice becomes a regex)."""
    if guided_backend is None:
        raise UnsupportedError(
            'structured_output: this TensorRT-LLM LLM was built without a guided decoding backend; set '
            'backends.trtllm.guided_decoding_backend = "xgrammar" (or "llguidance")'
        )
    so = p.structured_output
    assert so is not None
    if so.choice:
        return ConfigRef("GuidedDecodingParams", {"regex": "(" + "|".join(re.escape(c) for c in so.choice) + ")"})
    key = next(k for k in ("json", "regex", "grammar") if getattr(so, k))
    return ConfigRef("GuidedDecodingParams", {key: getattr(so, key)})


def _sampling(p: SamplingParams) -> dict[str, Any]:
    if p.greedy:
        return {"temperature": 0.0}
    out: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}
    if p.min_p > 0:
        out["min_p"] = p.min_p
    return out


def _penalties(p: SamplingParams, prompt_len: int, kwargs: dict[str, Any]) -> None:
    if p.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = p.repetition_penalty
    if p.presence_penalty or p.frequency_penalty:
        kwargs["presence_penalty"] = p.presence_penalty
        kwargs["frequency_penalty"] = p.frequency_penalty
        # lmdock (like vLLM) counts only output tokens for these two; TensorRT-LLM counts the prompt too
        kwargs["prompt_ignore_length"] = prompt_len
