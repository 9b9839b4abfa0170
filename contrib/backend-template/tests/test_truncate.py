"""The reference engine's ``truncate`` (speculative decoding, issue 42), held to lmdock-conformance's
check: every logit after a truncate equals a fresh sequence's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lmdock import BackendError
from lmdock_conformance.truncate import check_truncate, load_step_engine


def test_truncate_gives_the_logits_of_a_sequence_without_the_dropped_tokens() -> None:
    engine = load_step_engine("template", str(Path(os.environ["LMDOCK_MODELS"]) / "stories260K"))
    try:
        assert check_truncate(engine) is None
        with pytest.raises(BackendError, match="sequence 7 holds no KV state"):
            engine.truncate(7, 0)
    finally:
        engine.close()
