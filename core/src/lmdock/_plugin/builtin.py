"""The core's built-in plugin: the FCFS scheduler, the reference sampler, structured output (llguidance)
and the speculative proposers (n-gram, draft model).

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


@hookimpl(trylast=True)
def lmdock_speculative_proposer(config: Any, engine: Any, model_config: Any) -> Any:
    # n-gram prompt lookup, or a draft model loaded as a step engine (lmdock._engine.proposers)
    if config.method == "ngram":
        from lmdock._engine.proposers import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft":
        from lmdock._engine.proposers import DraftProposer
        from lmdock._plugin.loader import load_draft_engine

        return DraftProposer(load_draft_engine(config, engine, model_config))
    return None
