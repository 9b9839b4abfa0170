"""What generation returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution (1 = most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's logprobs: token id -> Logprob (the chosen token and the top ``k``).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    #: read by ``LLM.chat`` when the model has a tool or reasoning parser (``lmdock.tools``): the text
    #: without thinking and calls (None when it is calls only), the thinking, the calls
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request: its prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: prompt tokens whose KV state came from the prefix cache (vLLM's name); None: the engine does not say
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape): ``outputs.embedding``, the prompt's token ids."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    """One pair's score: the cross-encoder's probability, or the cosine similarity of the embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's shape): ``outputs.score``; ``prompt_token_ids`` are the
    pair's tokens as the model read them (a cross-encoder's joint input, else both prompts' tokens)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
