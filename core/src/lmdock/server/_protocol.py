"""Request bodies in OpenAI's shapes (with vLLM's sampling extras), their mapping to SamplingParams
through the one table of OpenAI's names (``lmdock._config.foreign.OPENAI_FIELDS``; the output constraints
through ``lmdock.server._structured``), and the usage object.

A field a body does not know is refused with a 400 naming it (and the closest known field), as
``lmdock batch`` refuses it: lmdock never silently drops what a request asks for.  A field sent as
``null`` asks for nothing and passes.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lmdock._config.foreign import OPENAI_FIELDS
from lmdock._llm.multimodal import IMAGE_PART_TYPES
from lmdock._llm.outputs import RequestOutput
from lmdock._llm.prompts import non_text_part
from lmdock._models.pooled import keep_alive_seconds
from lmdock.server._errors import APIError
from lmdock.server._structured import structured_output


class StrictBody(BaseModel):
    """A request body (or a part of one) that refuses a field it does not know, naming it and the
    closest known one, and a string that is no valid Unicode (a lone surrogate), naming where.

    ``neutral_fields``: fields of other servers that routers in front of lmdock fill in (vllm-router
    sends SGLang's with their defaults), accepted at the one value that asks for what lmdock does
    anyway and refused at any other."""

    model_config = ConfigDict(extra="ignore")  # a null unknown field; any other is refused below
    neutral_fields: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = [f.alias or name for name, f in cls.model_fields.items()]  # a body's names (json, not json_)
            for key, value in data.items():
                if key in cls.neutral_fields and key not in known:
                    if value is None or value == cls.neutral_fields[key]:
                        continue
                    raise PydanticCustomError("unknown_field", "{message}", {"field": key, "message": (
                        f"{key}={value!r} is not supported by lmdock serve, which takes {key} only as "
                        f"{cls.neutral_fields[key]!r} (what it does anyway): remove it")})
                if value is not None and key not in known:
                    raise PydanticCustomError("unknown_field", "{message}", {"field": key, "message": unknown_field(key, known)})
        where = _lone_surrogate(data, "")
        if where is not None:
            raise PydanticCustomError("invalid_text", "{message}", {"message": f"{where or 'the body'} holds a lone UTF-16 "
                                      "surrogate (such as \\ud800), which is not text: send valid Unicode"})
        return data


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode (a lone surrogate, which
    JSON's \\u escapes can carry and no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def unknown_field(key: str, known: Any) -> str:
    """The message refusing ``key``: the closest known field, or the known ones."""
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"this request's fields: {', '.join(sorted(known))}"
    return f"unknown field {key!r}: lmdock serve refuses what it would not honour; {hint}"


class StreamOptions(StrictBody):
    include_usage: bool = False


class StructuredOutputs(StrictBody):
    """vLLM's ``structured_outputs`` object: one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # not BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(StrictBody):
    #: SGLang's, as vllm-router sends them: stop strings trimmed from the text, no hidden states
    neutral_fields: ClassVar[dict[str, Any]] = {"no_stop_trim": False, "return_hidden_states": False}
    # OpenAI's ranges (a float past them, or inf/nan, is a 400 naming the field, as OpenAI answers)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's too: token ids as the object's keys
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Ollama's: how long the model stays loaded once idle, from this request on (seconds or "5m"; < 0: for ever)
    keep_alive: float | None = None

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        return None if value is None else keep_alive_seconds(value)

    def max_tokens_field(self) -> str | None:
        """The name under which the client asked for a number of tokens, or None (the defaults apply)."""
        if getattr(self, "max_completion_tokens", None) is not None:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None

    def overrides(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (``max_completion_tokens`` wins over ``max_tokens``)."""
        out: dict[str, Any] = {}
        for name, key in OPENAI_FIELDS.items():
            value = getattr(self, name, None)
            if value is not None:
                out[key] = value
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        so = structured_output(self)
        if so is not None:
            out["structured_output"] = so
        return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    max_completion_tokens: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty: give a string, a list of strings, token ids or a list of token-id lists", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def prompt_only(self) -> bool:
        """``echo`` with a token count of 0: score the prompt (vLLM's way to get a prompt's logprobs)."""
        return self.echo and 0 in (self.max_tokens, self.max_completion_tokens)

    def max_tokens_field(self) -> str | None:
        return None if self.prompt_only() else super().max_tokens_field()

    def overrides(self) -> dict[str, Any]:
        out = super().overrides()
        if self.prompt_only():
            if self.stream:
                raise APIError(400, "echo with max_tokens 0 scores the prompt and streams nothing: send stream: false",
                               param="stream")
            out["max_new_tokens"] = 1  # the engine computes one token, which the answer leaves out
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            if self.echo:
                out["prompt_logprobs"] = self.logprobs
        if self.suffix:
            raise APIError(400, "suffix is not supported: lmdock completes at the end of the prompt only", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported; use n", param="best_of")
        return out


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class ChatRequest(_Sampling):
    #: and for chat: reasoning separated from the answer (with the model's reasoning parser), streamed, included
    neutral_fields: ClassVar[dict[str, Any]] = {**_Sampling.neutral_fields, "separate_reasoning": True,
                                                "stream_reasoning": True, "include_reasoning": True}
    messages: list[dict[str, Any]]

    @model_validator(mode="after")
    def _text_parts_only(self) -> ChatRequest:
        """Content parts other than text and images (``input_audio``...) are refused: a part the
        model would never see must not pass as if it had been (images: lmdock._llm.multimodal)."""
        check_roles(self.messages)
        found = non_text_part(self.messages, ("text", *IMAGE_PART_TYPES))
        if found is not None:
            where, kind = found
            raise APIError(400, f"{where} is a {kind!r} part; lmdock reads text and image parts (image_url), and the model "
                                "would not see it: send text or image parts only", param=where.replace("[", ".").replace("]", "") + ".type")
        return self
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    # tools (lmdock.tools: the model's tool_parser reads the calls; a forced tool_choice constrains them)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def overrides(self) -> dict[str, Any]:
        out = super().overrides()
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return out


def check_roles(messages: list[dict[str, Any]]) -> None:
    """Each chat message's ``role`` is a string: a template would render any other value as if it
    were one (a role ``{"x": 1}`` ran as a message of no role)."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise APIError(400, f"messages.{i}.role must be a string (system, user, assistant, tool...), not "
                                f"{type(message.get('role')).__name__}", param=f"messages.{i}.role")


class LoadLoRAAdapterRequest(StrictBody):
    """vLLM's ``/v1/load_lora_adapter``; ``model``: the base model (lmdock serves several; default: the first)."""

    lora_name: str
    lora_path: str
    model: str | None = None


class UnloadLoRAAdapterRequest(StrictBody):
    lora_name: str
    lora_int_id: int | None = None
    model: str | None = None


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered with the messages, as chat renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _roles(self) -> TokenizeRequest:
        check_roles(self.messages or [])
        return self


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(StrictBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None


class ScoreRequest(StrictBody):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(StrictBody):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


def usage(outs: list[RequestOutput | None]) -> dict[str, Any]:
    """OpenAI's ``usage``: prompt and completion tokens of every finished output, and the prompt
    tokens the prefix cache gave (``prompt_tokens_details.cached_tokens``; left out where the engine
    does not count them)."""
    done = [o for o in outs if o is not None]
    p = sum(len(o.prompt_token_ids) for o in done)
    c = sum(len(c.token_ids) for o in done for c in o.outputs)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if done and all(o.num_cached_tokens is not None for o in done):
        out["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in done)}
    return out
