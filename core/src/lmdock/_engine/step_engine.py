"""The base class of step engines: the step-engine contract's optional members as real methods and
attributes with their defaults (transformers' ``Cache`` is the model: a base class that carries the
optional), so the core reads them directly instead of probing each engine with ``hasattr``.

An engine written without the base keeps working: ``lmdock._engine.adapters.as_step_engine`` gives it
the base's defaults for whatever it lacks, once, as the loader hands it to the loop.  That module is the
one place where the core looks at which optional members an engine has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from lmdock._plugin.errors import RequestError, UnsupportedError

if TYPE_CHECKING:
    from lmdock._engine.adapter_cache import AdapterCache
    from lmdock._engine.request_engine import EngineKind
    from lmdock._llm.lora import LoRARequest
    from lmdock._llm.tokenizer import Tokenizer
    from lmdock._plugin.contract import SeqChunk, StepOutput

NO_LORA_FIX = "send the request without lora_request, or load the model on a backend that lists lora in `lmdock backends`"


def no_images(engine: str) -> UnsupportedError:
    """The refusal of a prompt with images by a step engine (class ``engine``) that cannot read them."""
    return UnsupportedError(f"this step engine ({engine}) cannot read images; remove the images, or load "
                            "a vision-language model on a backend that lists vision in `lmdock backends`")


class StepEngineBase:
    """What a step backend's load hook returns, with the optional members filled in.

    A subclass implements ``step``, ``release`` and ``num_sequences`` (and ``fork`` where it can copy a
    sequence's KV state, ``close`` where it holds resources), and sets what differs from the defaults.
    """

    #: The kind the loader reads: the core schedules and samples around this engine.
    kind: ClassVar[EngineKind] = "step"

    #: Most tokens the KV state can hold across all sequences (None: bounded only by max_num_seqs).
    kv_capacity_tokens: int | None = None
    #: False where the state cannot be cut back to fewer positions than it covers (a recurrent / SSM
    #: state summarises them all): ``fork`` is then asked only at the length the state stands at, and
    #: automatic prefix caching reuses a cached prompt only where the new prompt extends all of it.
    fork_truncates: bool = True
    #: True where ``truncate`` cuts a sequence back (rejected speculative drafts): the core speculates
    #: only on such an engine (``[models.NAME.speculative]``, docs/speculative.md); the default cannot.
    truncates: bool = False
    #: True where ``step`` spends its time outside the GIL and leaves a CPU core free (its forward
    #: runs on an accelerator): the core then detokenizes and delivers the previous step's outputs on
    #: a helper thread while ``step`` runs (``[scheduler] async_output`` overrides it).
    overlap_host_work: bool = False
    #: Scheduler limits the engine narrows (``{"max_num_seqs": 4}``: lmdock-hf's offload picks the
    #: batch it streams for), applied over ``[models.NAME.scheduler]``; None: the config's as they are.
    scheduler_limits: dict[str, Any] | None = None
    #: The LoRA adapters the engine keeps loaded (a :class:`lmdock.backend.AdapterCache` made at load
    #: by a backend that declares ``lora``); None: the engine runs no adapters.
    adapters: AdapterCache[Any] | None = None

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_seq_len: int, eos_token_ids: Sequence[int],
                 generation_config: dict[str, Any] | None = None, kv_capacity_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.eos_token_ids = tuple(eos_token_ids)
        #: explicit keys of the model's generation_config.json (the first layer of sampling defaults)
        self.generation_config = generation_config if generation_config is not None else {}
        self.kv_capacity_tokens = kv_capacity_tokens

    # -- required ---------------------------------------------------------------------------------

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        """Append each chunk to its sequence's KV state and return next-token logits."""
        raise NotImplementedError(f"{type(self).__name__} must implement step")

    def release(self, seq_id: int) -> None:
        """Forget a sequence's KV state at once (finished, aborted or preempted)."""
        raise NotImplementedError(f"{type(self).__name__} must implement release")

    def num_sequences(self) -> int:
        """How many sequences the engine holds KV state for now (zero when no request is in flight)."""
        raise NotImplementedError(f"{type(self).__name__} must implement num_sequences")

    # -- optional, with defaults ------------------------------------------------------------------

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        """Copy the first ``length`` KV positions of ``src`` into a new ``dst``.  The default cannot:
        False, and the core computes the positions instead."""
        return False

    def truncate(self, seq_id: int, length: int) -> bool:
        """Drop the KV positions ``>= length`` of ``seq_id``.  The default cannot (nor can a recurrent
        state): False, and the core does without."""
        return False

    def prepare_lora(self, lora: LoRARequest) -> None:
        """Load (or check) a request's adapter, in the submitting thread; raise to refuse that request
        alone.  Chunks then name it.  The default: the engine's ``adapters`` does, or it is refused."""
        if self.adapters is None:
            raise RequestError(f"lora_request {lora.name!r}: this step engine ({type(self).__name__}) runs no LoRA adapters; "
                               f"{NO_LORA_FIX}")
        self.adapters.prepare(lora)

    @property
    def max_loras(self) -> int:
        """Adapters kept loaded (reported in /metrics); 0 for an engine that runs none."""
        return self.adapters.max_loras if self.adapters is not None else 0

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        """A prompt with images (a backend that declares ``vision``), in the submitting thread: its token
        ids with the image placeholders expanded as the model's processor does, ``data.processed``
        (``lmdock._llm.multimodal.MultiModalData``) filled for the prefill chunks to carry.  The
        default cannot read images."""
        raise no_images(type(self).__name__)

    def thread_exit(self) -> None:
        """Called in the engine thread as it ends, for resources that belong to that thread (MLX streams)."""

    def close(self) -> None:
        """Free the engine's resources; called once, after every sequence is released."""
