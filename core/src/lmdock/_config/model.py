"""A model's configuration: the resolved ``[models.NAME]`` entry and its engine tables (quantization,
build, KV cache, scheduler, offload).  Each type is a frozen dataclass that holds its defaults in one place
and validates itself on construction; backends translate these into their engine's own arguments, or
refuse with a reason.  TensorRT-LLM's field names are accepted where it has its own
(:func:`lmdock._config.foreign.accepts_foreign_fields`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lmdock._config.base import Editable, Replaceable, in_range, integer
from lmdock._config.foreign import accepts_foreign_fields
from lmdock._config.pooling import PoolingParams
from lmdock._config.schema import check
from lmdock._config.server import replica_tables
from lmdock._config.speculative import SpeculativeConfig
from lmdock._llm.lora import ADAPTER_NAME


@accepts_foreign_fields
@dataclass(frozen=True)
class QuantConfig(Replaceable):
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
class BuildConfig(Editable, Replaceable):
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
        integer("max_loras", self.max_loras, 1)
        integer("max_lora_rank", self.max_lora_rank, 1)
        integer("max_batch_size", self.max_batch_size, 1)
        integer("max_num_tokens", self.max_num_tokens, 1)
        integer("max_seq_len", self.max_seq_len, 1)
        integer("max_beam_width", self.max_beam_width, 1, optional=False)
        integer("tensor_parallel_size", self.tensor_parallel_size, 1, optional=False)
        integer("pipeline_parallel_size", self.pipeline_parallel_size, 1, optional=False)


@accepts_foreign_fields
@dataclass(frozen=True)
class KvCacheConfig(Replaceable):
    """Portable KV-cache settings."""

    dtype: Literal["auto", "float32", "float16", "bfloat16", "fp8", "int8"] = "auto"
    max_tokens: int | None = None
    memory_fraction: float | None = None
    cpu_space_gib: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        integer("max_tokens", self.max_tokens, 1)
        in_range("memory_fraction", self.memory_fraction, 0.0, 1.0, lo_open=True)
        in_range("cpu_space_gib", self.cpu_space_gib, 0.0, lo_open=True)



@dataclass(frozen=True)
class SchedulerConfig(Replaceable):
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
        integer("max_num_seqs", self.max_num_seqs, 1, optional=False)
        integer("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=False)
        integer("max_waiting", self.max_waiting, 1, optional=False)
        check(bool(self.policy), "policy", "must name a scheduling policy, such as 'fcfs'")


@dataclass(frozen=True)
class OffloadPolicy(Replaceable):
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
        in_range("weights_gpu_percent", self.weights_gpu_percent, 0.0, 100.0)
        in_range("weights_cpu_percent", self.weights_cpu_percent, 0.0, 100.0)
        total = self.weights_gpu_percent + self.weights_cpu_percent
        check(total <= 100.0, "weights_cpu_percent",
              f"weights_gpu_percent + weights_cpu_percent must be <= 100, got {total}")
        in_range("kv_cache_gpu_percent", self.kv_cache_gpu_percent, 0.0, 100.0)
        integer("compress_group_size", self.compress_group_size, 2, optional=False)
        check(self.compress_group_size % 2 == 0, "compress_group_size",
              f"must be even (two 4-bit values per byte), got {self.compress_group_size}")
        in_range("memory_budget_gib", self.memory_budget_gib, 0.0, lo_open=True)
        integer("batch_size", self.batch_size, 1)

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
    pooling: PoolingParams = field(default_factory=PoolingParams)
    #: ``[models.NAME.speculative]`` (``lmdock._config.speculative``): off by default
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
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

