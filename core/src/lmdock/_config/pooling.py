"""How ``LLM.embed`` and ``LLM.score`` pool an embedding model's hidden states (embedding pooling,
not the model pool of ``lmdock._models``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lmdock._config.base import Replaceable, integer
from lmdock._config.schema import check

#: Pooling types: the [CLS] token's hidden state, the mean over the prompt's tokens, the last token's.
POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass(frozen=True)
class PoolingParams(Replaceable):
    """How ``LLM.embed`` and ``LLM.score`` pool and post-process (vLLM's / furiosa-llm's ``PoolingParams``).

    A field left at None takes the model's own setting (its sentence-transformers files), then the
    config file's ``[models.NAME.pooling]`` table.

    * ``normalize``: scale each embedding to unit length.
    * ``dimensions``: keep the first ``dimensions`` values (Matryoshka truncation; applied before
      ``normalize``).
    * ``truncate_prompt_tokens``: cut a longer prompt to this many tokens (-1: the model's maximum);
      without it, a prompt longer than the model takes is refused.
    * ``pooling_type``: ``"CLS"``, ``"MEAN"`` or ``"LAST"``, over the model's own.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    pooling_type: Literal["CLS", "MEAN", "LAST", "cls", "mean", "last"] | None = None

    def __post_init__(self) -> None:
        integer("dimensions", self.dimensions, 1)
        if self.truncate_prompt_tokens != -1:
            integer("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        if self.pooling_type is not None:
            check(str(self.pooling_type).upper() in POOLING_TYPES, "pooling_type",
                  f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())

    def over(self, base: PoolingParams) -> PoolingParams:
        """These params with ``base``'s value wherever a field here is None."""
        return PoolingParams(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                                for f in dataclasses.fields(self)})
