"""Speculative decoding's engine contract (issue 42): verify rows and ``truncate`` on a step engine.

A verify row is a multi-token chunk with ``all_logits`` on a sequence the engine holds, mixed with
decode rows; ``truncate(seq_id, length)`` drops the rejected positions.  After it, every logit must be
that of a sequence that never held them (``lmdock_conformance.truncate``).  An engine without
``truncate``, or whose ``truncate`` returns False for the model, skips with the reason: the core runs
it without speculation.  Request backends run speculation inside their engine and skip."""

from __future__ import annotations

from typing import Any

import pytest

from lmdock_conformance.truncate import check_truncate, load_step_engine


@pytest.fixture(scope="module")
def step_engine(lmdock_setup: Any) -> Any:
    if lmdock_setup.spec.kind != "step":
        pytest.skip(f"backend {lmdock_setup.backend!r} is a request backend: speculation runs inside its engine")
    if not lmdock_setup.model:
        raise pytest.UsageError("pass --lmdock-model=PATH")
    backend_options = lmdock_setup.options.get("backends", {}).get(lmdock_setup.backend)
    engine = load_step_engine(lmdock_setup.backend, lmdock_setup.model, backend_options)
    yield engine
    engine.close()


def test_truncate_gives_the_logits_of_a_sequence_without_the_dropped_tokens(step_engine: Any) -> None:
    reason = check_truncate(step_engine)
    if reason is not None:
        pytest.skip(reason)
