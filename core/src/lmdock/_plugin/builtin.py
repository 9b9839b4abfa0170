"""The core's built-in plugin: the FCFS scheduler, the reference sampler and structured output (llguidance).

Registered like any other plugin, first, so third-party implementations that declare
``tryfirst=True`` (or simply answer for their own policy names) take precedence.
"""

from __future__ import annotations

from typing import Any

from lmdock._plugin.markers import hookimpl


@hookimpl(trylast=True)
def lmdock_make_scheduler(config: Any, max_seq_len: int, kv_capacity_tokens: int | None) -> Any:
    if config.policy != "fcfs":
        return None
    from lmdock._engine.scheduler import FcfsScheduler

    return FcfsScheduler(config, max_seq_len, kv_capacity_tokens)


@hookimpl(trylast=True)
def lmdock_make_sampler(backend: str, model_config: Any) -> Any:
    from lmdock._engine.sampler import ReferenceSampler

    return ReferenceSampler()


@hookimpl(trylast=True)
def lmdock_make_constraints(backend: str, model_config: Any, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    # Structured output on llguidance; llguidance itself is imported on the first request that asks.
    from lmdock._engine.structured import ConstraintFactory

    return ConstraintFactory(tokenizer, vocab_size, eos_token_ids)
