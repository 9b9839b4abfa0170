"""The requests an ``LLM`` call submits: sampling parameters resolved over the model's defaults, a
prompt tokenized and checked against what the backend can do, and a batch of any size fed to the
engine as its queue drains."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmdock._config.sampling import EditableSamplingParams, SamplingParams
from lmdock._config.schema import build, resolve_aliases
from lmdock._llm.lora import LoRARequest
from lmdock._llm.multimodal import prepare, split_prompt
from lmdock._llm.outputs import RequestOutput
from lmdock._llm.progress import Progress
from lmdock._llm.prompts import Prompt, as_prompt, indexed, indexed_error, truncated
from lmdock._llm.streams import RequestFuture
from lmdock._plugin.contract import EngineRequest
from lmdock._plugin.errors import ConfigError, QueueFullError, RequestError, UnsupportedError

if TYPE_CHECKING:
    from lmdock._config.model import ModelConfig

#: Sampling parameters as a call takes them: complete params, overrides of the defaults, or None.
ParamsArg = SamplingParams | dict[str, Any] | None

#: generation_config.json keys that become sampling defaults (only those the file sets explicitly).
_GENERATION_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")

_ids = itertools.count()


def default_params(generation_config: dict[str, Any] | None, mc: ModelConfig) -> SamplingParams:
    """The parameters a call that passes none runs with: generation_config.json, then the config file."""
    gen = generation_config or {}
    fields = {k: gen[k] for k in _GENERATION_KEYS if gen.get(k) is not None}
    if gen.get("do_sample") is False and "temperature" not in mc.sampling:
        fields["temperature"] = 0.0
    fields = {k: v for k, v in fields.items() if k != "max_new_tokens" or v > 0}
    fields.update(mc.sampling)
    try:
        return build(SamplingParams, fields, source=mc.source, prefix="sampling")
    except ConfigError:  # a generation_config.json value we cannot honour: keep the file's layer out
        return build(SamplingParams, dict(mc.sampling), source=mc.source, prefix="sampling")


def resolve_params(defaults: SamplingParams, params: ParamsArg) -> SamplingParams:
    """``LLM.sampling_params``: a dict's fields over ``defaults``, complete params as they are."""
    if params is None:
        return defaults
    if isinstance(params, EditableSamplingParams):
        return params.frozen()  # a snapshot: editing it later never reaches a running request
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):  # the call's names (max_tokens...) resolved before the defaults join them
        call = resolve_aliases(SamplingParams, params, source="<call>", prefix="sampling_params")
        fields = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
        return build(SamplingParams, {**fields, **call}, source="<call>", prefix="sampling_params")
    raise TypeError(f"sampling_params must be SamplingParams, a dict or None, not {type(params).__name__}")


def engine_request(llm: Any, prompt: Prompt, params: SamplingParams, stream: bool = False, add_special_tokens: bool = True,
                   tokenizer_kwargs: dict[str, Any] | None = None, lora_request: LoRARequest | None = None) -> EngineRequest:
    """``prompt`` tokenized and checked against ``llm``'s backend: a RequestError (UnsupportedError)
    naming the field it cannot honour."""
    prompt, images = split_prompt(prompt)  # vLLM's {"prompt", "multi_modal_data"}: the images apart
    prompt = as_prompt(prompt)
    backend = llm.backend
    if lora_request is not None:
        ok, reason = backend.capability("lora")
        if not ok:
            raise UnsupportedError(f"lora_request: backend {backend.name!r} cannot run LoRA adapters ({reason}); remove "
                                   "lora_request, or pick a backend that lists lora in `lmdock backends`")
    if llm.tokenizer is None and params.detokenize:  # skip_tokenizer_init: token ids out, no text
        params = params.replace(detokenize=False)
    multi_modal = None
    if images is not None:  # decoded under llm.image_limits; the engine's processor expands the placeholders
        ids, multi_modal = prepare(llm.engine, backend, prompt, images, add_special_tokens, llm.image_limits)
        text: str | None = prompt
    elif isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token or a non-empty string")
        ids = _encode(llm, prompt, add_special_tokens, tokenizer_kwargs)
        text = prompt
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids, text = list(prompt), None
    else:
        raise RequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}: {prompt!r:.80}")
    if params.structured_output is not None:
        ok, reason = backend.capability("structured_output")
        if not ok:
            raise RequestError(f"structured_output: backend {backend.name!r} cannot constrain its output ({reason}); pick a backend that lists structured_output in `lmdock backends`")
        llm.check_grammar(params)
    if params.logits_processors and backend.kind == "request":
        raise RequestError(f"logits_processors: backend {backend.name!r} samples inside its engine, where lmdock cannot run "
                           "Python callables; use a step backend (hf, onnx, mlx, llamacpp) or structured_output")
    ids = truncated(ids, params.truncate_prompt_tokens, llm.max_model_len)
    if params.biased:
        ok, reason = backend.capability("logit_bias")
        if not ok:
            asked = ", ".join(n for n in ("logit_bias", "allowed_token_ids", "bad_words") if getattr(params, n) not in ({}, None, ()))
            raise RequestError(f"{asked}: backend {backend.name!r} cannot bias or ban tokens ({reason}); remove it, or pick a "
                               "backend that lists logit_bias in `lmdock backends`")
    return EngineRequest(f"req-{next(_ids)}", text, ids, params, stream, lora_request, multi_modal)


def _encode(llm: Any, text: str, add_special_tokens: bool, tokenizer_kwargs: dict[str, Any] | None) -> list[int]:
    if llm.tokenizer is None:
        raise RequestError(f"backend {llm.backend.name!r} was loaded without a tokenizer; pass token ids")
    kwargs = {"add_special_tokens": add_special_tokens, **(tokenizer_kwargs or {})}
    try:
        return llm.tokenizer.encode(text, **kwargs)  # type: ignore[no-any-return]
    except TypeError as exc:
        if not tokenizer_kwargs:
            raise
        raise RequestError(f"tokenizer_kwargs {sorted(tokenizer_kwargs)}: the tokenizer's encode refused them ({exc})") from None


def run_batch(submit: Callable[[EngineRequest], RequestFuture], requests: list[EngineRequest], window: int,
              use_tqdm: bool | None) -> list[RequestOutput]:
    """Run a batch of any size: requests are fed as the engine's queue drains (vLLM's ``generate``
    takes any number of prompts), at most ``window`` at once, so ``scheduler.max_waiting`` bounds
    concurrent submitters, not one large offline batch."""
    futures: dict[int, RequestFuture] = {}
    results: list[RequestOutput | None] = [None] * len(requests)
    todo = deque(range(len(requests)))
    progress = Progress(len(requests), use_tqdm if use_tqdm is not None else (None if len(requests) >= 16 else False))
    try:
        while todo or futures:
            while todo and len(futures) < window:
                i = todo.popleft()
                futures[i] = indexed(i, len(requests), submit, requests[i])
            done, _ = concurrent.futures.wait(futures.values(), return_when=concurrent.futures.FIRST_COMPLETED)
            full = False
            for i in [i for i, f in futures.items() if f in done]:
                fut = futures.pop(i)
                error = fut.exception()
                if isinstance(error, QueueFullError):  # other submitters filled the queue: retry later
                    todo.appendleft(i)
                    full = True
                    continue
                if error is not None:
                    raise indexed_error(i, len(requests), error)
                out = fut.result()
                results[i] = out
                progress.update(sum(len(o.token_ids) for o in out.outputs))
            if full and not futures:
                time.sleep(0.01)
        return results  # type: ignore[return-value]
    except BaseException:
        for fut in futures.values():
            fut.cancel()
        raise
