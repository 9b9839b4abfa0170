"""lmdock's requests into vLLM's objects and vLLM's outputs back into lmdock's.

``_translate.py`` holds the mapping as plain keyword arguments (no ``vllm`` import); here they become
``vllm.SamplingParams``, and vLLM's completions and logprobs become lmdock's
:class:`~lmdock.backend.CompletionOutput` and :class:`~lmdock.backend.Logprob`.
"""

from __future__ import annotations

from typing import Any

from lmdock import RequestError
from lmdock.backend import CompletionOutput, Logprob


def sampling_params(kwargs: dict[str, Any]) -> Any:
    """``vllm.SamplingParams`` from :func:`lmdock_vllm._translate.sampling_kwargs`' output (or the
    same shape); vLLM validates here, so a bad value fails its request alone with a RequestError."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = dict(kwargs, output_kind=RequestOutputKind[kwargs["output_kind"]])
    if kwargs.get("structured_outputs") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**{k: v for k, v in kwargs["structured_outputs"].items() if v is not None})
    try:
        return SamplingParams(**kwargs)
    except Exception as exc:  # ValueError, TypeError, vLLM's VLLMValidationError: this request alone fails
        raise RequestError(f"vLLM refused the sampling parameters: {exc}") from None


def lora_request(lora: Any, int_id: int) -> Any:
    """``vllm.lora.request.LoRARequest`` for an lmdock LoRARequest, under vLLM's adapter id ``int_id``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora.name, int_id, lora.path)


def one_token_params(logprobs: int) -> Any:
    """One greedy token with ``logprobs`` logprobs (-1: the whole vocabulary), token ids only, final
    output only: a next-token query, or one beam's step."""
    return sampling_params({"max_tokens": 1, "temperature": 0.0, "logprobs": logprobs, "detokenize": False, "output_kind": "FINAL_ONLY"})


def completion(c: Any, previous: CompletionOutput | None) -> CompletionOutput:
    """One of vLLM's ``CompletionOutput`` as lmdock's; ``previous`` is the same completion's last
    snapshot, whose converted logprobs a cumulative stream reuses."""
    return CompletionOutput(
        index=c.index,
        text=c.text or "",
        token_ids=list(c.token_ids),
        cumulative_logprob=c.cumulative_logprob,
        logprobs=more_logprobs(previous.logprobs if previous else None, c.logprobs),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def more_logprobs(done: list[Any] | None, value: Any) -> list[Any] | None:
    """Cumulative logprobs of a streamed completion: convert only the positions not seen before."""
    if value is None or not done:
        return logprobs(value)
    return done + (logprobs(value[len(done):]) or [])


def logprobs(value: Any) -> list[dict[int, Logprob] | None] | None:
    """vLLM's per-position ``{token_id: Logprob}`` lists (or FlatLogprobs) -> lmdock's."""
    if value is None:
        return None
    return [
        None if pos is None else {int(t): Logprob(float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in pos.items()}
        for pos in value
    ]
