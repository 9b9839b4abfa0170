"""Portable, validated configuration types shared by every backend.

Each type is a frozen dataclass that holds its defaults in one place and validates itself on
construction: an invalid value raises ``ValueError`` (a :class:`~lmdock._schema.FieldError`) naming
the field and the allowed range.  Backends translate these into their engine's own arguments, or
refuse with a reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

from lmdock._aliases import foreign_fields, foreign_sampling_fields
from lmdock._lora import ADAPTER_NAME
from lmdock._schema import check

_INF = float("inf")


def _range(name: str, value: float | None, lo: float, hi: float = _INF, *, lo_open: bool = False) -> None:
    if value is None:
        return
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    bracket = "(" if lo_open else "["
    upper = "inf)" if hi == _INF else f"{hi}]"
    check(ok, name, f"must be in {bracket}{lo}, {upper}, got {value!r}")


def _int(name: str, value: Any, lo: int, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
    check(value >= lo, name, f"must be >= {lo}, got {value!r}")


#: Ray Serve's ``autoscaling_config`` keys that ``autoscaling`` takes (``min`` and ``max`` are short for
#: ``min_replicas`` and ``max_replicas``), and its ``ray_actor_options`` keys that ``ray_actor_options`` takes
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests", "upscale_delay_s",
                    "downscale_delay_s")
ACTOR_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")


def replica_tables(replicas: int | None, autoscaling: dict[str, Any] | None,
                   actor: dict[str, Any] | None) -> dict[str, Any] | None:
    """Check a table's ``replicas``, ``autoscaling`` and ``ray_actor_options`` (``lmdock serve`` on Ray
    Serve, ``server/_ray.py``); return ``autoscaling`` with ``min`` / ``max`` spelt as Ray does."""
    _int("replicas", replicas, 1)
    for key, value in (actor or {}).items():
        check(key in ACTOR_KEYS, "ray_actor_options", f"unknown key {key!r}; known: {', '.join(ACTOR_KEYS)}")
        if key in ("num_cpus", "num_gpus"):
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, f"ray_actor_options.{key}",
                  f"must be a number >= 0, got {value!r}")
        elif key == "memory":
            _int("ray_actor_options.memory", value, 1, optional=False)
        elif key == "resources":
            check(isinstance(value, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in value.values()),
                  "ray_actor_options.resources", f"must be a table of custom resource amounts, got {value!r}")
        else:
            check(isinstance(value, str) and bool(value), "ray_actor_options.accelerator_type",
                  f"must be a Ray accelerator type such as 'A100', got {value!r}")
    if autoscaling is None:
        return None
    check(replicas is None, "autoscaling", "give replicas (a fixed count) or autoscaling, not both")
    table = {}
    for key, value in autoscaling.items():
        full = {"min": "min_replicas", "max": "max_replicas"}.get(key, key)
        check(full in AUTOSCALING_KEYS, "autoscaling", f"unknown key {key!r}; known: min, max, {', '.join(AUTOSCALING_KEYS)}")
        check(full not in table, "autoscaling", f"{key!r} and {full!r} say the same; give one")
        table[full] = value
    for key in ("min_replicas", "max_replicas", "initial_replicas"):
        _int(f"autoscaling.{key}", table.get(key), 0 if key != "max_replicas" else 1)
    check("max_replicas" in table, "autoscaling", "needs max (the most replicas to scale to)")
    check(table.get("min_replicas", 1) <= table["max_replicas"], "autoscaling",
          f"min ({table.get('min_replicas')}) is above max ({table['max_replicas']})")
    for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
        value = table.get(key)
        check(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0),
              f"autoscaling.{key}", f"must be a number >= 0, got {value!r}")
    check(table.get("target_ongoing_requests", 1) > 0, "autoscaling.target_ongoing_requests", "must be > 0")
    return table


class _Replaceable:
    def replace(self, **changes: Any) -> Any:
        """Return a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class _Editable:
    """Fields may be set after construction (TensorRT-LLM's ``build_config.max_beam_width = 4``,
    vLLM's ``sp.max_tokens = 40``); each assignment is validated as construction is, and a name in the
    class's ``ALIASES`` sets the field it names."""

    def __setattr__(self, name: str, value: Any) -> None:
        name = getattr(type(self), "ALIASES", {}).get(name, name)
        if name not in {f.name for f in dataclasses.fields(self)}:  # type: ignore[arg-type]
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        if name not in self.__dict__:  # the dataclass's own __init__ setting it
            object.__setattr__(self, name, value)
            return
        new = dataclasses.replace(self, **{name: value})  # type: ignore[type-var]
        self.__dict__.update(new.__dict__)


@dataclass(frozen=True)
class StructuredOutput(_Replaceable):
    """Constrain the output to a JSON schema, a regular expression, one of some strings, or an EBNF
    grammar: exactly one of them (vLLM's ``StructuredOutputsParams``).  Backends that can constrain
    declare the ``structured_output`` capability; the others refuse the request."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "choice", tuple(self.choice or ()))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        check(len(given) == 1, "structured_output",
              f"set exactly one of json, regex, choice, grammar; got {', '.join(given) or 'none'}")
        for c in self.choice:
            check(isinstance(c, str) and c != "", "structured_output.choice", f"choices must be non-empty strings, got {c!r}")

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema ``json`` asks for, as a dict: ``"object"`` is any JSON object (OpenAI's
        ``response_format: json_object``), a string is JSON text; None when ``json`` is unset.
        Raises :class:`lmdock.RequestError` naming ``structured_output.json`` when it is neither."""
        import json

        from lmdock._errors import RequestError

        schema = self.json
        if schema is None or schema == {}:
            return None
        if isinstance(schema, str):
            if schema.strip() == "object":
                return {"type": "object"}
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(f'structured_output.json: a string must be "object" or a JSON schema as JSON text; it is not JSON ({exc})') from None
        if not isinstance(schema, dict):
            raise RequestError(f"structured_output.json: a JSON schema is an object, got {type(schema).__name__}")
        return schema


@dataclass(frozen=True)
class SamplingParams(_Replaceable):
    """How to sample one request: the fields of Modular MAX's and vLLM's ``SamplingParams``.

    Processing order (the reference sampler's, and the semantics every backend must keep; vLLM's):
    ``allowed_token_ids`` (every other token masked) -> ``bad_words`` -> ``logit_bias`` (added to
    the logits) -> penalties (repetition over prompt and output, frequency and presence over output)
    -> min_new_tokens masking of EOS and stop tokens -> temperature (0 is greedy) -> min_p -> top_k ->
    top_p -> draw with the request's own seeded generator.  Logprobs are the model's own, before
    any of these.

    * ``logit_bias``: token id -> a value in [-100, 100] added to that token's logit (OpenAI's
      meaning: -100 in effect bans the token, 100 makes it the only choice).
    * ``allowed_token_ids``: when set, every generated token is one of these.
    * ``bad_words``: words never generated, as vLLM bans them: each word is tokenized without and
      with a leading space, and the last token of such a sequence is banned wherever the tokens
      before it end the output so far.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = 16
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_output: StructuredOutput | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    #: keep only the last k prompt tokens (-1: as many as the model takes), vLLM's left truncation
    truncate_prompt_tokens: int | None = None
    #: per-request callables ``(token_ids, logits) -> logits`` (step engines; see docs/migrating.md)
    logits_processors: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        _token_fields(self)
        if isinstance(self.structured_output, dict):
            object.__setattr__(self, "structured_output", StructuredOutput(**self.structured_output))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        _int("n", self.n, 1, optional=False)
        _range("temperature", self.temperature, 0.0)
        _int("top_k", self.top_k, 0, optional=False)
        _range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _range("min_p", self.min_p, 0.0, 1.0)
        _range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _range("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        _int("max_new_tokens", self.max_new_tokens, 1)
        _int("min_new_tokens", self.min_new_tokens, 0, optional=False)
        if self.max_new_tokens is not None:
            check(
                self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens",
                f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
            )
        for s in self.stop:
            check(isinstance(s, str) and s != "", "stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            check(isinstance(t, int) and t >= 0, "stop_token_ids", f"must be token ids >= 0, got {t!r}")
        _int("seed", self.seed, 0)
        _int("logprobs", self.logprobs, 0)
        _int("prompt_logprobs", self.prompt_logprobs, 0)
        _int("beam_width", self.beam_width, 1, optional=False)
        if self.beam_width > 1:
            check(self.temperature == 0.0 or self.temperature == 1.0, "temperature",
                  "beam search is deterministic; leave temperature at 0 or 1")
            check(self.n <= self.beam_width, "n", f"must be <= beam_width ({self.beam_width}), got {self.n}")
        if self.truncate_prompt_tokens != -1:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        for proc in self.logits_processors:
            check(callable(proc), "logits_processors", f"must be callables (token_ids, logits) -> logits, got {proc!r:.60}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self) -> EditableSamplingParams:
        """An editable copy (vLLM's ``clone()``): ``sp.max_tokens = 40`` sets and validates one field.
        A request takes a frozen snapshot of it, so editing it later never reaches a running request."""
        return EditableSamplingParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def __getattr__(self, name: str) -> Any:
        """Other tools' names read as the field they name (``sp.max_tokens`` is ``max_new_tokens``)."""
        aliases = getattr(type(self), "ALIASES", {})
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __hash__(self) -> int:
        # logit_bias is a dict (OpenAI's shape): hashed by its items, so SamplingParams stays hashable
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                          for v in (getattr(self, f.name) for f in dataclasses.fields(self))))

    @property
    def biased(self) -> bool:
        """True when ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)


def _token_id(name: str, value: Any) -> int:
    """A token id given as an int or (a JSON object's key) a decimal string."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name,
          f"token ids are integers >= 0, got {value!r}")
    return int(value)


def _token_fields(p: SamplingParams) -> None:
    """Validate and normalise logit_bias (int keys), allowed_token_ids and bad_words (tuples)."""
    bias = p.logit_bias
    check(isinstance(bias, dict), "logit_bias", f"must map token ids to values in [-100, 100], got {type(bias).__name__}")
    normal: dict[int, float] = {}
    for key, value in bias.items():
        check(isinstance(value, (int, float)) and not isinstance(value, bool) and -100.0 <= value <= 100.0, "logit_bias",
              f"token {key!r}: a bias is a number in [-100, 100], got {value!r}")
        normal[_token_id("logit_bias", key)] = float(value)
    object.__setattr__(p, "logit_bias", normal)
    if p.allowed_token_ids is not None:
        ids = (p.allowed_token_ids,) if isinstance(p.allowed_token_ids, int) else p.allowed_token_ids
        object.__setattr__(p, "allowed_token_ids", tuple(_token_id("allowed_token_ids", t) for t in ids))
        check(bool(p.allowed_token_ids), "allowed_token_ids", "is empty: name at least one token, or leave it unset (None)")
    words = (p.bad_words,) if isinstance(p.bad_words, str) else tuple(p.bad_words or ())
    for w in words:
        check(isinstance(w, str) and w.strip() != "", "bad_words", f"bad words are non-empty strings, got {w!r}")
    object.__setattr__(p, "bad_words", words)


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
SamplingParams.ALIASES = {  # type: ignore[attr-defined]
    **{name: field for name, field in OPENAI_FIELDS.items() if name != field},
    "num_beams": "beam_width",
    "num_return_sequences": "n",
    "stop_sequences": "stop",
    "structured_outputs": "structured_output",  # vLLM's
    "random_seed": "seed",  # TensorRT-LLM's
}
_sampling_init = SamplingParams.__init__


def _sampling_params_init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    kwargs = foreign_sampling_fields(kwargs)
    if kwargs.pop("use_beam_search", False):
        if "best_of" in kwargs:
            kwargs.setdefault("beam_width", kwargs.pop("best_of"))
        kwargs.setdefault("temperature", 0.0)
    elif "best_of" in kwargs:
        raise TypeError("SamplingParams has no best_of (best-of-n sampling): for beam search pass beam_width=N; "
                        "for several samples pass n=N")
    for alias, name in SamplingParams.ALIASES.items():  # type: ignore[attr-defined]
        if alias in kwargs:
            value = kwargs.pop(alias)
            if name in kwargs and kwargs[name] != value:
                raise TypeError(f"SamplingParams: {alias!r} is another name for {name!r}; give one of them")
            kwargs[name] = value
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    for key in kwargs:
        if key not in names:
            import difflib

            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its fields: {', '.join(sorted(names))}"
            raise TypeError(f"SamplingParams got an unexpected keyword argument {key!r}{hint}")
    _sampling_init(self, *args, **kwargs)


_sampling_params_init.__doc__ = _sampling_init.__doc__
_sampling_params_init.__signature__ = inspect.signature(_sampling_init)  # type: ignore[attr-defined]
SamplingParams.__init__ = _sampling_params_init  # type: ignore[method-assign]


class EditableSamplingParams(_Editable, SamplingParams):
    """What :meth:`SamplingParams.clone` and ``LLM.get_default_sampling_params()`` return: the same
    fields, settable one by one with validation.  Equal to a SamplingParams with the same fields."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(SamplingParams))

    def frozen(self) -> SamplingParams:
        """A frozen snapshot, what a request holds."""
        return SamplingParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)})


def _frozen_setattr(self: SamplingParams, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to field {name!r}: SamplingParams is frozen (one object serves many requests); "
        "sp.clone() or llm.get_default_sampling_params() give an editable copy, sp.replace(...) a changed one")


SamplingParams.__setattr__ = _frozen_setattr  # type: ignore[method-assign,assignment]


@dataclass(frozen=True)
class QuantConfig(_Replaceable):
    """Portable quantization request; each backend translates it or refuses with a reason."""

    algo: Literal[
        "none", "int8_weight_only", "int4_weight_only", "int8_dynamic", "awq", "gptq", "fp8"
    ] = "none"
    group_size: int | None = None
    checkpoint_prequantized: bool = False

    def __post_init__(self) -> None:
        if self.group_size is not None:
            check(self.group_size in (32, 64, 128, 256), "group_size",
                  f"must be one of 32, 64, 128, 256, got {self.group_size!r}")

    @property
    def enabled(self) -> bool:
        return self.algo != "none"


@dataclass
class BuildConfig(_Editable, _Replaceable):
    """Portable engine limits and build options (TensorRT-LLM's BuildConfig, vLLM's engine args)."""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "auto"
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    max_beam_width: int = 1
    compile: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor: Literal["auto", "mp", "ray"] = "auto"
    #: LoRA adapters (``LoRARequest``) kept loaded at once (None: the backend's default), and the
    #: largest rank an adapter may have (None: any); a backend without ``lora`` refuses either
    max_loras: int | None = None
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        _int("max_loras", self.max_loras, 1)
        _int("max_lora_rank", self.max_lora_rank, 1)
        _int("max_batch_size", self.max_batch_size, 1)
        _int("max_num_tokens", self.max_num_tokens, 1)
        _int("max_seq_len", self.max_seq_len, 1)
        _int("max_beam_width", self.max_beam_width, 1, optional=False)
        _int("tensor_parallel_size", self.tensor_parallel_size, 1, optional=False)
        _int("pipeline_parallel_size", self.pipeline_parallel_size, 1, optional=False)


@dataclass(frozen=True)
class KvCacheConfig(_Replaceable):
    """Portable KV-cache settings."""

    dtype: Literal["auto", "float32", "float16", "bfloat16", "fp8", "int8"] = "auto"
    max_tokens: int | None = None
    memory_fraction: float | None = None
    cpu_space_gib: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        _range("memory_fraction", self.memory_fraction, 0.0, 1.0, lo_open=True)
        _range("cpu_space_gib", self.cpu_space_gib, 0.0, lo_open=True)


def _accept_foreign_fields(cls: type) -> None:
    """Let ``cls(...)`` take TensorRT-LLM's field names (lmdock._aliases.FIELDS)."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **foreign_fields(cls.__name__, kwargs))

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


_accept_foreign_fields(QuantConfig)
_accept_foreign_fields(KvCacheConfig)


@dataclass(frozen=True)
class SchedulerConfig(_Replaceable):
    """How requests are ordered and batched (the core's scheduler for step engines)."""

    policy: str = "fcfs"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_waiting: int = 4096
    #: Detokenize and deliver a step's outputs on a helper thread while the engine computes the
    #: next step (vLLM's async output processing).  None: when the engine says its step leaves the
    #: GIL and a CPU core free (``StepEngine.overlap_host_work``: its forward runs on an accelerator).
    async_output: bool | None = None

    def __post_init__(self) -> None:
        _int("max_num_seqs", self.max_num_seqs, 1, optional=False)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=False)
        _int("max_waiting", self.max_waiting, 1, optional=False)
        check(bool(self.policy), "policy", "must name a scheduling policy, such as 'fcfs'")


@dataclass(frozen=True)
class OffloadPolicy(_Replaceable):
    """Where weights and KV cache live, and how they are compressed: FlexLLMGen's ``Policy`` with
    portable names (docs/backends/hf.md maps one onto the other).

    Weights: ``weights_gpu_percent`` on the accelerator, ``weights_cpu_percent`` in RAM, the rest on
    disk, under ``offload_dir`` (default: lmdock's cache, ``$LMDOCK_CACHE_DIR`` or
    ``~/.cache/lmdock``) and streamed layer by layer.  On a machine without an accelerator the
    accelerator share is RAM too.  KV cache: ``kv_cache_gpu_percent`` on the accelerator, the rest in
    RAM.  ``compress_weight`` / ``compress_cache`` store weights / KV group-wise quantized to 4 bits
    (``compress_group_size`` values per group, FlexLLMGen's 64).  ``prefetch`` overlaps reading the
    next layer with computing the current one.  ``memory_budget_gib``, when set, lets the backend pick
    the placement and the batch itself from a cost model, and say what it chose; ``batch_size`` is
    the most sequences that pass through each layer together (FlexLLMGen's
    ``gpu_batch_size * num_gpu_batches``; None: the scheduler's ``max_num_seqs``).
    """

    weights_gpu_percent: float = 100.0
    weights_cpu_percent: float = 0.0
    offload_dir: str | None = None
    kv_cache_gpu_percent: float = 100.0
    compress_weight: bool = False
    compress_cache: bool = False
    compress_group_size: int = 64
    prefetch: bool = True
    memory_budget_gib: float | None = None
    batch_size: int | None = None

    def __post_init__(self) -> None:
        _range("weights_gpu_percent", self.weights_gpu_percent, 0.0, 100.0)
        _range("weights_cpu_percent", self.weights_cpu_percent, 0.0, 100.0)
        total = self.weights_gpu_percent + self.weights_cpu_percent
        check(total <= 100.0, "weights_cpu_percent",
              f"weights_gpu_percent + weights_cpu_percent must be <= 100, got {total}")
        _range("kv_cache_gpu_percent", self.kv_cache_gpu_percent, 0.0, 100.0)
        _int("compress_group_size", self.compress_group_size, 2, optional=False)
        check(self.compress_group_size % 2 == 0, "compress_group_size",
              f"must be even (two 4-bit values per byte), got {self.compress_group_size}")
        _range("memory_budget_gib", self.memory_budget_gib, 0.0, lo_open=True)
        _int("batch_size", self.batch_size, 1)

    @property
    def disk_percent(self) -> float:
        """The share of the weights kept on disk."""
        return max(0.0, 100.0 - self.weights_gpu_percent - self.weights_cpu_percent)

    @property
    def enabled(self) -> bool:
        """True when anything differs from "everything resident on the accelerator"."""
        return (
            self.weights_gpu_percent < 100.0
            or self.kv_cache_gpu_percent < 100.0
            or self.compress_weight
            or self.compress_cache
            or self.memory_budget_gib is not None
            or self.batch_size is not None
        )


@dataclass(frozen=True)
class ServerConfig(_Replaceable):
    """The ``[server]`` table: how ``lmdock serve`` listens, whom it lets in and how much it takes.

    The API key comes from ``--api-key``, else ``$LMDOCK_API_KEY``, else ``api_key_file`` (its first
    line), else ``api_key`` (write ``"${env.VAR}"`` rather than the key itself); with none, no key is
    asked for.  ``max_queue`` bounds each model's sequences in flight (running and waiting; a request
    counts its prompts x ``n`` (or beams)); by default it is the model's ``scheduler.max_num_seqs +
    scheduler.max_waiting``.  ``max_n``, ``max_logprobs`` (vLLM's default, and OpenAI's top_logprobs
    bound), ``max_stop_strings`` and ``max_stop_length`` bound the work one request may ask for;
    ``template_timeout`` and ``max_prompt_chars`` bound a chat template's render (``server/_templates.py``).
    ``memory_budget_gib`` and ``max_loaded_models`` bound the models loaded at once (``server/_pool.py``):
    the least recently used idle model is unloaded to make room; None is no bound.
    ``max_header_bytes``, ``max_headers``, ``header_timeout``, ``keep_alive_timeout`` and
    ``max_connections`` bound what a connection may cost before any route runs (``server/_http.py``).
    ``metric_names = "vllm"`` also exports the engine gauges under vLLM's ``vllm:`` names, which the
    Gateway API Inference Extension (llm-d, KServe) reads from a model server (``server/_metrics.py``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None
    max_body_bytes: int = 1048576
    max_queue: int | None = None
    retry_after: int = 1
    cors_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0
    chat_template: str | None = None
    max_n: int = 128
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_length: int = 1024
    #: a request's own ``chat_template`` (a program the client sends) is refused unless this is on
    trust_request_chat_template: bool = False
    #: ``/v1/load_lora_adapter`` (a client names a folder on this machine) is refused unless this is on
    #: (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
    allow_runtime_lora_updating: bool = False
    #: the Responses API's store of recent responses (``previous_response_id``), bounded in bytes of
    #: compact JSON and in count; the least recently used response goes first (``server/_response_store.py``)
    response_store_max_bytes: int = 134_217_728
    response_store_max_items: int = 1024
    template_timeout: float = 5.0
    max_prompt_chars: int = 4_194_304
    memory_budget_gib: float | None = None
    max_loaded_models: int | None = None
    max_header_bytes: int = 32768
    max_headers: int = 100
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 512
    metric_names: Literal["lmdock", "vllm"] = "lmdock"
    #: a ``max_tokens`` past what the context leaves after the prompt, on the OpenAI routes (completions,
    #: chat): ``"refuse"`` (a 400 naming the room left, as vLLM answers) or ``"clamp"`` (cut to the room, the
    #: finish reason ``length`` when reached).  ``/v1/messages`` and ``/v1/responses`` always clamp: agent
    #: clients send a large ``max_tokens`` whatever the model's context (as llama.cpp and Ollama clamp).
    max_tokens_past_context: Literal["refuse", "clamp"] = "refuse"
    #: images in requests (docs/vision.md): at most ``max_images_per_request`` a request, each at most
    #: ``max_image_pixels`` (read from its header, before decoding); file paths only under ``image_dir``
    #: (None: none read); http(s) URLs are never fetched
    max_images_per_request: int = 8
    max_image_pixels: int = 16_777_216
    image_dir: str | None = None
    #: each model's engine as this many Ray Serve replicas behind the one server (1: no Ray; ``server/_ray.py``),
    #: or as many as Ray Serve's autoscaler keeps between ``autoscaling``'s min and max; each replica an actor
    #: with ``ray_actor_options`` (``num_cpus`` 1 unless given).  A model's own keys win over these.
    replicas: int = 1
    autoscaling: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins or ()))
        _range("memory_budget_gib", self.memory_budget_gib, 0.0, lo_open=True)
        _int("max_loaded_models", self.max_loaded_models, 1)
        for name in ("max_n", "max_stop_strings", "max_stop_length"):
            _int(name, getattr(self, name), 1, optional=False)
        _int("max_logprobs", self.max_logprobs, 0, optional=False)
        _int("max_prompt_chars", self.max_prompt_chars, 1, optional=False)
        _int("max_images_per_request", self.max_images_per_request, 1, optional=False)
        _int("max_image_pixels", self.max_image_pixels, 1, optional=False)
        _int("response_store_max_bytes", self.response_store_max_bytes, 0, optional=False)
        _int("response_store_max_items", self.response_store_max_items, 0, optional=False)
        for name in ("max_header_bytes", "max_headers", "max_connections"):
            _int(name, getattr(self, name), 1, optional=False)
        for name in ("header_timeout", "keep_alive_timeout"):
            check(getattr(self, name) > 0, name, f"must be > 0 seconds, got {getattr(self, name)}")
        check(self.template_timeout > 0, "template_timeout", f"must be > 0 seconds, got {self.template_timeout}")
        check(bool(self.host), "host", "must be a host name or address, such as '127.0.0.1'")
        _int("port", self.port, 0, optional=False)
        check(self.port <= 65535, "port", f"must be <= 65535, got {self.port}")
        _int("max_body_bytes", self.max_body_bytes, 1, optional=False)
        _int("max_queue", self.max_queue, 1)
        _int("retry_after", self.retry_after, 1, optional=False)
        _range("shutdown_timeout", self.shutdown_timeout, 0.0)
        check(self.api_key is None or self.api_key != "", "api_key", "is empty; remove it or give a key")
        _int("replicas", self.replicas, 1, optional=False)
        object.__setattr__(self, "autoscaling", replica_tables(None if self.replicas == 1 else self.replicas,
                                                               self.autoscaling, self.ray_actor_options))
        check(self.max_tokens_past_context in ("refuse", "clamp"), "max_tokens_past_context",
              f"must be 'refuse' (a 400, as vLLM answers) or 'clamp' (cut to the context), got {self.max_tokens_past_context!r}")
        check(self.metric_names in ("lmdock", "vllm"), "metric_names",
              f"must be 'lmdock' (lmdock: names only) or 'vllm' (also vLLM's vllm: names), got {self.metric_names!r}")


@dataclass(frozen=True)
class ModelConfig:
    """A resolved model entry: what a backend's load hook receives."""

    model: str
    name: str | None = None
    backend: str = "auto"
    fallback: tuple[str, ...] = ()
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    #: how the model writes tool calls and thinking (``lmdock.tools``; None: recognized from the chat template / none)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    quantization: QuantConfig = field(default_factory=QuantConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    pooling: PoolingParams = field(default_factory=lambda: PoolingParams())
    sampling: dict[str, Any] = field(default_factory=dict)
    backends: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    #: for a server (or any ``ModelPool`` user) holding several models: seconds idle before the model
    #: is unloaded (0: as soon as it is idle; -1: never), always loaded (``pin``), loaded at start (``preload``)
    keep_alive: float = -1
    pin: bool = False
    preload: bool = False
    #: ``[models.NAME.adapters]``: LoRA adapter folders by name, which ``lora_request="NAME"`` names
    adapters: dict[str, str] = field(default_factory=dict)
    #: for ``lmdock serve``: this model's engine as Ray Serve replicas (over ``[server]``'s keys of these names)
    replicas: int | None = None
    autoscaling: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check(bool(self.model), "model", "must be a local path or a hub id")
        for adapter in self.adapters:
            check(bool(ADAPTER_NAME.fullmatch(adapter)), "adapters",
                  f"an adapter name is 1 to 64 letters, digits, '.', '_' and '-' (a server serves it as MODEL:ADAPTER), "
                  f"got {adapter!r}")
        check(self.keep_alive == -1 or self.keep_alive >= 0, "keep_alive",
              f"must be seconds >= 0, or -1 (never unload), got {self.keep_alive!r}")
        object.__setattr__(self, "autoscaling", replica_tables(self.replicas, self.autoscaling, self.ray_actor_options))

    def backend_options(self, backend: str) -> dict[str, Any]:
        """The raw ``[models.NAME.backends.BACKEND]`` table (validated by that backend)."""
        return dict(self.backends.get(backend, {}))


#: Pooling types: the [CLS] token's hidden state, the mean over the prompt's tokens, the last token's.
POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass(frozen=True)
class PoolingParams(_Replaceable):
    """How ``LLM.embed`` and ``LLM.score`` pool and post-process (vLLM's / furiosa-llm's ``PoolingParams``).

    A field left at None takes the model's own setting (its sentence-transformers files), then the
    config file's ``[models.NAME.pooling]`` table.

    * ``normalize``: scale each embedding to unit length.
    * ``dimensions``: keep the first ``dimensions`` values (Matryoshka truncation; applied before
      ``normalize``).
    * ``truncate_prompt_tokens``: cut a longer prompt to this many tokens (-1: the model's maximum);
      without it, a prompt longer than the model takes is refused.
    * ``pooling_type``: ``"CLS"``, ``"MEAN"`` or ``"LAST"``, over the model's own.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    pooling_type: Literal["CLS", "MEAN", "LAST", "cls", "mean", "last"] | None = None

    def __post_init__(self) -> None:
        _int("dimensions", self.dimensions, 1)
        if self.truncate_prompt_tokens != -1:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        if self.pooling_type is not None:
            check(str(self.pooling_type).upper() in POOLING_TYPES, "pooling_type",
                  f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())

    def over(self, base: PoolingParams) -> PoolingParams:
        """These params with ``base``'s value wherever a field here is None."""
        return PoolingParams(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                                for f in dataclasses.fields(self)})
