"""The base classes of request engines and pooling engines: the optional members of the request-engine
contract as real methods and attributes with their defaults, and each engine KIND declared on its class
(``step``, ``request``, ``pooling``), which the loader reads instead of probing the engine's members.

An engine written without a base keeps working: ``lmdock._engine.adapters`` tells its kind from its
members and gives it the defaults it lacks, once, as the loader hands it to the facade.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lmdock._plugin.errors import UnsupportedError

if TYPE_CHECKING:
    import numpy as np

    from lmdock._llm.lora import LoRARequest
    from lmdock._llm.tokenizer import Tokenizer
    from lmdock._plugin.contract import EngineRequest, OutputSink, PoolingInput

#: What a backend's load hook may return: a step engine (the core schedules and samples), a request
#: engine (it does both itself), or a pooling engine (embeddings and scores).
EngineKind = Literal["step", "request", "pooling"]


class RequestEngineBase:
    """What a request backend's load hook returns (vLLM, TensorRT-LLM), and what the facade speaks to:
    the core's step loop (``StepRunner``) and pooling batcher are request engines too.

    A subclass implements ``submit`` and ``abort`` and sets ``tokenizer``, ``max_seq_len`` and
    ``generation_config`` (the constructor below does, where the subclass calls it); every other member
    has a default that means "this engine does not do that".
    """

    #: The kind the loader reads: this engine takes whole requests.
    kind: ClassVar[EngineKind] = "request"
    #: True where ``submit`` must run on the caller's event loop and compiles nothing there (lmdock
    #: serve's Ray front end); False: a request with a grammar is submitted from a worker thread.
    submit_on_loop: ClassVar[bool] = False

    tokenizer: Tokenizer | None
    max_seq_len: int
    #: explicit keys of the model's generation_config.json (the first layer of sampling defaults)
    generation_config: dict[str, Any]

    def __init__(self, tokenizer: Tokenizer | None, *, max_seq_len: int, generation_config: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.generation_config = generation_config if generation_config is not None else {}

    # -- required ---------------------------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue a request without blocking; thread-safe.  Raise for a request refused at once."""
        raise NotImplementedError(f"{type(self).__name__} must implement submit")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its state; its sink gets a final output with reason "abort"."""
        raise NotImplementedError(f"{type(self).__name__} must implement abort")

    # -- optional, with defaults ------------------------------------------------------------------

    def prepare_lora(self, lora: LoRARequest) -> None:
        """Load (or check) a request's adapter ahead of ``submit``, in a worker thread, so a first use
        (disk reads) never blocks a server's event loop.  The default: nothing (``submit`` reads it)."""

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        """A prompt with images as token ids, in the submitting thread.  The default: the text
        tokenized as it is (a request engine such as vLLM runs the model's processor itself, on the
        ``multi_modal`` data ``submit`` gets)."""
        if self.tokenizer is None:
            raise UnsupportedError(f"{type(self).__name__} has no tokenizer to read a prompt with images; load it with one")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def next_token_logprobs(self, token_ids: Sequence[int]) -> concurrent.futures.Future[np.ndarray]:
        """A future of the log-probabilities (float32, [vocab]) of the token after ``token_ids``.  The
        default cannot: ``UnsupportedError`` (the facade adds the backend's reason)."""
        raise UnsupportedError(f"{type(self).__name__} has no next_token_logprobs")

    def clear_cache(self) -> None:
        """Drop the engine's prefix caches and the KV state they hold.  The default keeps none."""

    def stats(self) -> dict[str, Any]:
        """Live counts for /metrics (``num_requests_running``, ``kv_cache_usage_perc``, ...); the
        default reports none."""
        return {}

    def close(self) -> None:
        """Free the engine's resources; requests in flight fail with ``EngineClosedError``."""


class PoolingEngineBase:
    """What a backend's load hook returns for an embedding model or a cross-encoder; the core wraps it in
    its pooling batcher.  A subclass sets the fields of ``lmdock.backend.PoolingEngine`` (``tokenizer``,
    ``max_seq_len``, ``task``, ``pooling_type``, ``normalize``, ``hidden_size``) and implements ``embed``
    as that protocol says."""

    #: The kind the loader reads: this engine pools hidden states (or a classifier's logits).
    kind: ClassVar[EngineKind] = "pooling"

    def embed(self, batch: Sequence[PoolingInput], pooling_type: str) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} must implement embed")

    def close(self) -> None:
        """Free the engine's resources."""
