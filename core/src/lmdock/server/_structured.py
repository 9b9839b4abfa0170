"""A request body's structured-output fields (vLLM's ``guided_*`` / ``structured_outputs``, OpenAI's
``response_format``) as ``SamplingParams.structured_output``: the mapping of
:mod:`lmdock._config.structured_fields` (shared with ``lmdock batch``), its refusals as 400s naming the field.
"""

from __future__ import annotations

from typing import Any

from lmdock._config.structured_fields import FIELDS, FieldRefused
from lmdock._config.structured_fields import structured_output as _mapping
from lmdock.server._errors import APIError


def structured_output(body: Any) -> dict[str, Any] | None:
    """The ``structured_output`` a parsed request body asks for, or None; an APIError(400) naming the field."""
    fields = {}
    for name in FIELDS:
        value = getattr(body, name, None)
        fields[name] = value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value
    try:
        return _mapping(fields)
    except FieldRefused as exc:
        raise APIError(400, str(exc), param=exc.param) from None
