"""Request bodies in OpenAI's shapes (with vLLM's sampling extras), and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmdock.server._errors import APIError


class _Body(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI's and vLLM's servers do.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    def overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n}
        names = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos",
                 "stop_token_ids": "stop_token_ids", "include_stop_str_in_output": "include_stop_str_in_output",
                 "skip_special_tokens": "skip_special_tokens"}
        for field, key in names.items():
            value = getattr(self, field)
            if value is not None:
                out[key] = value
        if self.max_tokens is not None:
            out["max_new_tokens"] = self.max_tokens
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
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

    def overrides(self) -> dict[str, Any]:
        out = super().overrides()
        if self.max_completion_tokens is not None:
            out["max_new_tokens"] = self.max_completion_tokens
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            if self.echo:
                out["prompt_logprobs"] = self.logprobs
        if self.suffix:
            raise APIError(400, "suffix is not supported: lmdock completes at the end of the prompt only", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported; use n", param="best_of")
        return out


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def overrides(self) -> dict[str, Any]:
        out = super().overrides()
        if self.max_completion_tokens is not None:
            out["max_new_tokens"] = self.max_completion_tokens
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                out["structured_output"] = {"json": {"type": "object"}}
            else:
                schema = (rf.json_schema or {}).get("schema")
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", param="response_format")
                out["structured_output"] = {"json": schema}
        return out


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
