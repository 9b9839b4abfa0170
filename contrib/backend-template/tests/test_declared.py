"""lmdock-template: what its BackendSpec declares works as `pip install lmdock-template` installs it
(the checks are lmdock-conformance's, shared by every first-party plugin)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmdock_conformance.declared import (
    declared_quantization_algorithms_load_and_generate,
    every_declared_capability_works,
)

MODEL = str(Path(os.environ["LMDOCK_MODELS"]) / "stories260K")
LOAD_OPTIONS: dict[str, Any] = {}


def test_every_declared_capability_works() -> None:
    every_declared_capability_works("template", MODEL, **LOAD_OPTIONS)


def test_declared_quantization_algorithms_load_and_generate() -> None:
    declared_quantization_algorithms_load_and_generate("template", MODEL, **LOAD_OPTIONS)
