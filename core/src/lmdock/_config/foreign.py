"""Other tools' names, read as lmdock's: the one table of them.

vLLM's, TensorRT-LLM's and furiosa-llm's users write their own spellings (``LLM(model, dtype="half",
max_model_len=512)``, ``LLM(p, build_config=BuildConfig(...))``, ``LLM(artifact_path=...)``); each
argument here either becomes the ``[models.NAME]`` key it means, or is refused with lmdock's
equivalent or why it does not apply.  docs/migrating.md is this table in prose.  The same module holds
every other foreign spelling lmdock reads, each derived from one source where they overlap:
``CONSTRUCTOR`` (``LLM(...)`` arguments), ``OPENAI_FIELDS`` (request fields, read by ``lmdock serve``,
``lmdock batch`` and the CLI's sampling flags), ``SAMPLING_ALIASES`` (``SamplingParams`` names: the request
fields' renames plus transformers' and TensorRT-LLM's), ``SAMPLING`` and ``FIELDS`` (TensorRT-LLM's names
that convert a value), ``GUIDED`` (vLLM's ``guided_*`` fields) and ``FOREIGN_FLAGS`` (other CLIs' flags,
the engine ones spelt from ``CONSTRUCTOR``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmdock._plugin.errors import ConfigError


@dataclass(frozen=True)
class Alias:
    """One foreign argument: the API it comes from, and either ``to`` (value -> options fragment, a
    nested dict of ``[models.NAME]`` keys) or ``refused`` (why not, and what to use instead).
    ``native``: for a name lmdock has too (``tokenizer``, ``quantization``), whether a value is
    lmdock's own (a path, a QuantConfig) rather than the other API's."""

    api: str
    to: Callable[[Any], dict[str, Any]] | None = None
    refused: str = ""
    native: Callable[[Any], bool] | None = None


def _key(path: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], dict[str, Any]]:
    """A fragment setting the dotted ``path`` (``build.dtype``) to ``convert(value)``."""

    def to(value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = convert(value)
        return out

    to.path = path  # type: ignore[attr-defined]  # read by FOREIGN_FLAGS
    return to


#: vLLM's dtype spellings -> lmdock's build.dtype.
_DTYPES = {"half": "float16", "float": "float32", "float16": "float16", "float32": "float32", "bfloat16": "bfloat16", "auto": "auto"}


def _dtype(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"dtype {value!r} (vLLM's LLM argument): lmdock's build.dtype takes {', '.join(sorted(_DTYPES))}", key="dtype")
    return _DTYPES[name]


#: vLLM's ``quantization`` strings: the checkpoint's own scheme (loaded as it is) or an online one.
_PREQUANTIZED = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq", "compressed-tensors": "none"}
_ONLINE = {"fp8": "fp8"}


def _quantization(value: str) -> dict[str, Any]:
    if value in _PREQUANTIZED:
        return {"quantization": {"algo": _PREQUANTIZED[value], "checkpoint_prequantized": True}}
    if value in _ONLINE:
        return {"quantization": {"algo": _ONLINE[value]}}
    raise ConfigError(
        f"quantization {value!r} (vLLM's LLM argument): lmdock names {', '.join(sorted({**_PREQUANTIZED, **_ONLINE}))} "
        "(quantization = {algo = ...}); for another vLLM scheme pass backends={'vllm': {'engine_args': {'quantization': ...}}}",
        key="quantization")


def _enforce_eager(value: Any) -> dict[str, Any]:
    # a build hint: no compiled graphs on any backend, vLLM's own switch where vLLM runs
    return {"build": {"compile": False}, "backends": {"vllm": {"enforce_eager": True}}} if value else {"backends": {"vllm": {"enforce_eager": False}}}


def _enable_lora(value: Any) -> dict[str, Any]:
    # lmdock loads adapters when a request names one (LoRARequest), on a backend that declares lora:
    # there is nothing to switch on, and nothing to switch off
    return {}


def _task(value: Any) -> dict[str, Any]:
    return {"@task": value}


def _tokenizer(value: Any) -> dict[str, Any]:
    """A path stays lmdock's ``tokenizer``; a tokenizer object (TensorRT-LLM's ``tokenizer=<obj>``) is
    loaded in the engine from the files it came from, so that the engine detokenizes with it too."""
    path = getattr(value, "name_or_path", None)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"tokenizer {type(value).__name__}: lmdock loads the tokenizer in the engine (which detokenizes "
                          "with it), from files: pass a transformers tokenizer (it has name_or_path) or its folder", key="tokenizer")
    return {"tokenizer": path}


def _skip_tokenizer_init(value: Any) -> dict[str, Any]:
    return {"@skip_tokenizer_init": True, "sampling": {"detokenize": False}} if value else {}


def _config_object(section: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {} if value is None else {section: value}


_HUB_CACHE = ("lmdock downloads through huggingface_hub's cache: set $HF_HUB_CACHE (or HF_HOME) to choose where, "
              "or give a local folder as the model")
_ENGINE_ARGS = "pass it to vLLM as it is: backends={'vllm': {'engine_args': {%r: ...}}}"

#: The table: every foreign ``LLM(...)`` argument lmdock knows, by name.
CONSTRUCTOR: dict[str, Alias] = {
    # vLLM (vllm.LLM / EngineArgs)
    "dtype": Alias("vLLM", _key("build.dtype", _dtype)),
    "max_model_len": Alias("vLLM", _key("build.max_seq_len")),
    "speculative_config": Alias("vLLM", _config_object("speculative")),
    "gpu_memory_utilization": Alias("vLLM", _key("kv_cache.memory_fraction")),
    "tensor_parallel_size": Alias("vLLM", _key("build.tensor_parallel_size")),
    "pipeline_parallel_size": Alias("vLLM", _key("build.pipeline_parallel_size")),
    "distributed_executor_backend": Alias("vLLM", _key("build.distributed_executor")),
    "seed": Alias("vLLM", _key("sampling.seed")),
    "quantization": Alias("vLLM", _quantization, native=lambda v: not isinstance(v, str)),
    "max_num_seqs": Alias("vLLM", _key("scheduler.max_num_seqs")),
    "max_num_batched_tokens": Alias("vLLM", _key("scheduler.max_num_batched_tokens")),
    "enable_prefix_caching": Alias("vLLM", _key("kv_cache.enable_prefix_caching")),
    "kv_cache_dtype": Alias("vLLM", _key("kv_cache.dtype")),
    "task": Alias("vLLM", _task),
    "runner": Alias("vLLM", _task),
    "enforce_eager": Alias("vLLM", _enforce_eager),
    "download_dir": Alias("vLLM", refused=_HUB_CACHE),
    "swap_space": Alias("vLLM", refused="vLLM's CPU swap for preempted requests; " + _ENGINE_ARGS % "swap_space"),
    "cpu_offload_gb": Alias("vLLM", refused="lmdock's portable offload is offload={...} (docs/backends/hf.md); on vLLM "
                                            + _ENGINE_ARGS % "cpu_offload_gb"),
    "max_loras": Alias("vLLM", _key("build.max_loras")),
    "max_lora_rank": Alias("vLLM", _key("build.max_lora_rank")),
    "enable_lora": Alias("vLLM", _enable_lora),
    "tokenizer": Alias("TensorRT-LLM", _tokenizer, native=lambda v: v is None or isinstance(v, str)),
    "skip_tokenizer_init": Alias("vLLM, TensorRT-LLM", _skip_tokenizer_init),
    # TensorRT-LLM (tensorrt_llm.LLM / LlmArgs)
    "build_config": Alias("TensorRT-LLM", _config_object("build")),
    "kv_cache_config": Alias("TensorRT-LLM", _config_object("kv_cache")),
    "quant_config": Alias("TensorRT-LLM", _config_object("quantization")),
    "scheduler_config": Alias("TensorRT-LLM, furiosa-llm", _config_object("scheduler")),
    "max_batch_size": Alias("TensorRT-LLM", _key("build.max_batch_size")),
    "max_num_tokens": Alias("TensorRT-LLM", _key("build.max_num_tokens")),
    "max_seq_len": Alias("TensorRT-LLM", _key("build.max_seq_len")),
    "max_beam_width": Alias("TensorRT-LLM", _key("build.max_beam_width")),
    # furiosa-llm (furiosa_llm.LLM)
    "model_id_or_path": Alias("furiosa-llm", _key("@model", str)),
    "artifact_path": Alias("furiosa-llm", _key("@model", str)),
    "cache_dir": Alias("furiosa-llm", refused=_HUB_CACHE),
    "devices": Alias("furiosa-llm", refused="lmdock places a model with build.device ('auto', 'cpu', 'cuda:1'...)"),
    "data_parallel_size": Alias("furiosa-llm", refused="lmdock runs one engine per LLM; for replicas use `lmdock serve --replicas N` (docs/scale-out.md)"),
    "served_model_name": Alias("furiosa-llm", refused="a served name is the model's name in the config file ([models.NAME]) for `lmdock serve`"),
}


@dataclass
class AfterLoad:
    """What a foreign argument asks of the loaded LLM: no tokenizer (``skip_tokenizer_init``), or a
    task the model must be loaded for (vLLM's ``task`` / ``runner``)."""

    skip_tokenizer_init: bool = False
    task: str | None = None

    #: vLLM's tasks and runners that pool (an embedding model or a cross-encoder) rather than generate
    POOLING = frozenset({"embed", "embedding", "score", "classify", "reward", "pooling"})
    GENERATING = frozenset({"generate", "auto", "draft"})

    def apply(self, llm: Any) -> None:
        if self.skip_tokenizer_init:
            llm.tokenizer = None  # prompts are token ids; outputs carry token ids and no text
        if self.task is None:
            return
        if self.task not in self.POOLING | self.GENERATING:
            raise ConfigError(f"task {self.task!r} (vLLM's task/runner): lmdock knows {', '.join(sorted(self.POOLING | self.GENERATING))}", key="task")
        pooling = llm.engine.kind == "pooling"
        if pooling == (self.task in self.POOLING) or self.task == "auto":
            return
        what = "an embedding model or a cross-encoder" if pooling else "a generative model"
        llm.shutdown()
        raise ConfigError(f"task {self.task!r}: {llm.model_config.model!r} is {what}; lmdock picks generation or pooling "
                          "from the model's files (a sentence-transformers folder, a BERT-style encoder, a sequence "
                          "classifier pool), so remove task= or load a model made for it", key="task")


def constructor_options(model: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any], AfterLoad]:
    """``LLM(model, **options)`` with every foreign argument replaced by the lmdock keys it means.
    A foreign argument and the lmdock key it sets, given different values, is a ConfigError."""
    foreign = [k for k, v in options.items() if k in CONSTRUCTOR and not (CONSTRUCTOR[k].native and CONSTRUCTOR[k].native(v))]
    if not foreign:
        return model, options, AfterLoad()
    out = {k: v for k, v in options.items() if k not in foreign}
    after = AfterLoad()
    for name in foreign:
        alias, value = CONSTRUCTOR[name], options[name]
        if alias.to is None:
            raise ConfigError(f"{name!r} is {alias.api}'s LLM argument, and lmdock has no such setting: {alias.refused}", key=name)
        fragment = alias.to(value)
        if "@model" in fragment:
            model = _merge_model(model, fragment.pop("@model"), name)
        after.task = fragment.pop("@task", after.task)
        after.skip_tokenizer_init = fragment.pop("@skip_tokenizer_init", after.skip_tokenizer_init)
        _merge(out, fragment, name)
    return model, out, after


def _merge_model(model: Any, value: str, name: str) -> str:
    if model is not None and str(model) != value:
        raise ConfigError(f"{name!r} names the model {value!r} and the model argument names {str(model)!r}: give one", key=name)
    return value


def _merge(out: dict[str, Any], fragment: dict[str, Any], name: str, path: str = "") -> None:
    for key, value in fragment.items():
        where = f"{path}.{key}" if path else key
        current = out.get(key)
        if isinstance(value, dict) and current is not None:
            if dataclasses.is_dataclass(current):  # build=BuildConfig(...) beside dtype=...: its set fields
                default = type(current)()
                current = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)
                           if f.init and getattr(current, f.name) != getattr(default, f.name)}
            if not isinstance(current, dict):
                raise ConfigError(f"{name!r} sets {where}, which is also given as {type(current).__name__}: give one", key=name)
            out[key] = dict(current)
            _merge(out[key], value, name, where)
        elif key in out and out[key] != value:
            raise ConfigError(f"{name!r} sets {where} = {value!r}, and {where} is also given as {out[key]!r}: give one", key=name)
        else:
            out[key] = value


# -- SamplingParams --------------------------------------------------------------------------------


def _end_id(value: Any) -> dict[str, Any]:
    # TensorRT-LLM's end_id is the token that ends a sequence; -1 is none (generate to max_tokens)
    return {"ignore_eos": True} if value == -1 else {"stop_token_ids": (value,)}


def _return_log_probs(value: Any) -> dict[str, Any]:
    return {"logprobs": 0} if value else {}


def _pad_id(value: Any) -> dict[str, Any]:
    # lmdock's outputs are lists of each completion's own tokens, never padded: there is nothing to pad
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"SamplingParams: pad_id must be a token id, got {value!r}")
    return {}


#: TensorRT-LLM's SamplingParams names that are not plain renames (those are SAMPLING_ALIASES).
SAMPLING: dict[str, Callable[[Any], dict[str, Any]]] = {
    "end_id": _end_id,
    "pad_id": _pad_id,
    "return_log_probs": _return_log_probs,
}


def foreign_sampling_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams(**kwargs)`` with TensorRT-LLM's ``end_id``, ``pad_id``, ``return_log_probs`` read
    as the lmdock fields they mean (given beside those fields, the lmdock field wins where it is set)."""
    if not any(k in SAMPLING for k in kwargs):
        return kwargs
    out = {k: v for k, v in kwargs.items() if k not in SAMPLING}
    for name, to in SAMPLING.items():
        if kwargs.get(name) is None:
            continue
        for field, value in to(kwargs[name]).items():
            if field == "stop_token_ids":  # added to the request's own stop tokens
                out[field] = tuple(out.get(field) or ()) + value
            else:
                out.setdefault(field, value)
    return out


# -- TensorRT-LLM's config classes ----------------------------------------------------------------


#: QuantAlgo names -> lmdock's QuantConfig.algo (the inverse of lmdock-trtllm's LEGACY_QUANT_ALGOS).
QUANT_ALGOS = {"NO_QUANT": "none", "W8A16": "int8_weight_only", "W4A16": "int4_weight_only", "W4A16_AWQ": "awq",
               "W4A16_GPTQ": "gptq", "FP8": "fp8"}


def _quant_algo(value: Any) -> str:
    name = str(getattr(value, "value", value)).rpartition(".")[2]  # a QuantAlgo member, its name, or "QuantAlgo.X"
    if name not in QUANT_ALGOS:
        raise ValueError(f"QuantConfig: quant_algo {name!r} (TensorRT-LLM's QuantAlgo) has no portable lmdock algo; "
                         f"lmdock takes {', '.join(QUANT_ALGOS)} (as {', '.join(QUANT_ALGOS.values())}), or load a checkpoint "
                         "quantized with it: QuantConfig(algo=..., checkpoint_prequantized=True)")
    return QUANT_ALGOS[name]


def _kv_cache_quant_algo(value: Any) -> str:
    raise ValueError("QuantConfig: kv_cache_quant_algo is lmdock's kv_cache.dtype ('fp8', 'int8'): "
                     "KvCacheConfig(dtype='fp8') / LLM(..., kv_cache={'dtype': 'fp8'})")


#: Config classes' foreign field names: class name -> {name: (lmdock field, convert or None)}.
FIELDS: dict[str, dict[str, tuple[str, Callable[[Any], Any] | None]]] = {
    "QuantConfig": {"quant_algo": ("algo", _quant_algo), "kv_cache_quant_algo": ("algo", _kv_cache_quant_algo)},
    "KvCacheConfig": {"free_gpu_memory_fraction": ("memory_fraction", None), "enable_block_reuse": ("enable_prefix_caching", None)},
}


def foreign_fields(cls_name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A config class's keyword arguments with TensorRT-LLM's names (``free_gpu_memory_fraction``,
    ``quant_algo``) read as lmdock's fields."""
    names = FIELDS.get(cls_name, {})
    if not any(k in names for k in kwargs):
        return kwargs
    out = {k: v for k, v in kwargs.items() if k not in names}
    for name, value in kwargs.items():
        if name in names:
            field, convert = names[name]
            value = convert(value) if convert is not None else value
            if field in out and out[field] != value:
                raise ValueError(f"{cls_name}: {name!r} is another name for {field!r}: give one of them")
            out[field] = value
    return out


def accepts_foreign_fields(cls: type) -> type:
    """Let ``cls(...)`` take TensorRT-LLM's field names (lmdock._config.foreign.FIELDS)."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **foreign_fields(cls.__name__, kwargs))

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


# -- request fields: OpenAI's and vLLM's, and SamplingParams' other names ---------------------------

#: The one table of OpenAI's request fields (with vLLM's sampling extras) that set a SamplingParams
#: field, and the field each sets: read by ``lmdock serve``, ``lmdock batch`` and SamplingParams'
#: aliases.  Where a request gives both ``max_tokens`` and ``max_completion_tokens``, the later wins.
OPENAI_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
}

#: Other tools' names for SamplingParams fields (OpenAI's and vLLM's from the table above, then
#: transformers'), accepted as those fields by ``SamplingParams(...)``, config files and call dicts.
#: vLLM's ``best_of`` is the beam width only with ``use_beam_search=True``; alone it (best-of-n
#: sampling) is refused with what to use instead.
SAMPLING_ALIASES = {
    **{name: field for name, field in OPENAI_FIELDS.items() if name != field},
    "num_beams": "beam_width",
    "num_return_sequences": "n",
    "stop_sequences": "stop",
    "structured_outputs": "structured_output",  # vLLM's
    "random_seed": "seed",  # TensorRT-LLM's
}

#: vLLM's ``guided_*`` request fields -> the StructuredOutput field each sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def sampling_kwargs(kwargs: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """``SamplingParams(**kwargs)``'s arguments under lmdock's field names: TensorRT-LLM's converted, vLLM's
    ``use_beam_search`` / ``best_of`` read, ``SAMPLING_ALIASES`` renamed; an unknown name is a TypeError with a
    did-you-mean from ``fields``."""
    kwargs = foreign_sampling_fields(kwargs)
    if kwargs.pop("use_beam_search", False):
        if "best_of" in kwargs:
            kwargs.setdefault("beam_width", kwargs.pop("best_of"))
        kwargs.setdefault("temperature", 0.0)
    elif "best_of" in kwargs:
        raise TypeError("SamplingParams has no best_of (best-of-n sampling): for beam search pass beam_width=N; "
                        "for several samples pass n=N")
    for alias, name in SAMPLING_ALIASES.items():
        if alias in kwargs:
            value = kwargs.pop(alias)
            if name in kwargs and kwargs[name] != value:
                raise TypeError(f"SamplingParams: {alias!r} is another name for {name!r}; give one of them")
            kwargs[name] = value
    for key in kwargs:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its fields: {', '.join(sorted(fields))}"
            raise TypeError(f"SamplingParams got an unexpected keyword argument {key!r}{hint}")
    return kwargs


# -- command-line flags ---------------------------------------------------------------------------

#: vLLM's engine flags that lmdock keeps in the config file: the ``LLM(...)`` arguments of the same name.
_CONFIG_FLAGS = ("max_model_len", "dtype", "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
                 "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")


def _config_key(name: str) -> str:
    section, _, key = CONSTRUCTOR[name].to.path.rpartition(".")  # type: ignore[union-attr]
    return f"[models.NAME.{section}] {key} in the config file"


#: Flags of other tools (vLLM's, llama.cpp's, OpenAI's habits), and where lmdock keeps the same setting.
FOREIGN_FLAGS: dict[str, str] = {
    **{"--" + name.replace("_", "-"): _config_key(name) for name in _CONFIG_FLAGS},
    "-tp": _config_key("tensor_parallel_size"),
    "--max-tokens": "--max-new-tokens",
    "--quantization": "[models.NAME.quantization] algo in the config file",
    "--trust-remote-code": "trust_remote_code = true under [models.NAME] in the config file",
    "--served-model-name": "the model's name in the config file ([models.NAME]) or -m NAME (lmdock serve takes it)",
    "--tool-call-parser": "tool_parser = \"hermes\" under [models.NAME] in the config file (docs/tools.md)",
    "--tool-parser": "tool_parser = \"hermes\" under [models.NAME] in the config file (docs/tools.md)",
    "--reasoning-parser": "reasoning_parser = \"think\" under [models.NAME] in the config file (docs/tools.md)",
    "--model": "-m / --model",
    "--ctx-size": _config_key("max_seq_len"),
    "--n-predict": "--max-new-tokens",
    "--temp": "--temperature",
}
