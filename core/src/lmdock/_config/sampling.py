"""How to sample one request: :class:`SamplingParams` (and its editable copy) and :class:`StructuredOutput`.

Each type is a frozen dataclass that holds its defaults in one place and validates itself on
construction: an invalid value raises ``ValueError`` (a :class:`~lmdock._config.schema.FieldError`) naming
the field and the allowed range.  Backends translate these into their engine's own arguments, or
refuse with a reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lmdock._config.base import Editable, Replaceable, in_range, integer
from lmdock._config.foreign import SAMPLING_ALIASES, sampling_kwargs
from lmdock._config.schema import check


@dataclass(frozen=True)
class StructuredOutput(Replaceable):
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

        from lmdock._plugin.errors import RequestError

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


def _frozen_setattr(self: SamplingParams, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to field {name!r}: SamplingParams is frozen (one object serves many requests); "
        "sp.clone() or llm.get_default_sampling_params() give an editable copy, sp.replace(...) a changed one")


def _foreign_names(cls: type) -> type:
    """SamplingParams' class decorator: ``cls(...)`` takes other tools' names as the fields they mean
    (:func:`lmdock._config.foreign.sampling_kwargs`), and assigning a field says how to get an editable copy."""
    init = cls.__init__
    fields = {f.name for f in dataclasses.fields(cls)}

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **sampling_kwargs(kwargs, fields))

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    cls.__setattr__ = _frozen_setattr  # type: ignore[assignment]
    return cls


@_foreign_names
@dataclass(frozen=True)
class SamplingParams(Replaceable):
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
    #: Other tools' names for these fields (``lmdock._config.foreign.SAMPLING_ALIASES``): read, written
    #: (on an editable copy) and passed to the constructor as the field each names
    ALIASES: ClassVar[dict[str, str]] = SAMPLING_ALIASES

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
        integer("n", self.n, 1, optional=False)
        in_range("temperature", self.temperature, 0.0)
        integer("top_k", self.top_k, 0, optional=False)
        in_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        in_range("min_p", self.min_p, 0.0, 1.0)
        in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        in_range("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        integer("max_new_tokens", self.max_new_tokens, 1)
        integer("min_new_tokens", self.min_new_tokens, 0, optional=False)
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
        integer("seed", self.seed, 0)
        integer("logprobs", self.logprobs, 0)
        integer("prompt_logprobs", self.prompt_logprobs, 0)
        integer("beam_width", self.beam_width, 1, optional=False)
        if self.beam_width > 1:
            check(self.temperature == 0.0 or self.temperature == 1.0, "temperature",
                  "beam search is deterministic; leave temperature at 0 or 1")
            check(self.n <= self.beam_width, "n", f"must be <= beam_width ({self.beam_width}), got {self.n}")
        if self.truncate_prompt_tokens != -1:
            integer("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
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


class EditableSamplingParams(Editable, SamplingParams):
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
