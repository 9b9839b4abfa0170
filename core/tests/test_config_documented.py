"""Config keys docs/config.md documents and no other test exercised (docs/tests/audit.md points here),
on the FAKE step engine (core plumbing only)."""

from __future__ import annotations

from typing import Any

import lmdock
import pytest
from lmdock import LLM, ConfigError
from lmdock._plugin import manager as _plugins


class _LastFirst:
    """A scheduling-policy plugin: ``[models.NAME.scheduler] policy = "test-lifo"`` picks it (it
    records that it was asked, and hands back the built-in FCFS scheduler)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    @lmdock.hookimpl
    def lmdock_make_scheduler(self, config: Any, max_seq_len: int, kv_capacity_tokens: int | None) -> Any:
        self.asked.append(config.policy)
        if config.policy != "test-lifo":
            return None
        from lmdock._engine.scheduler import FcfsScheduler

        return FcfsScheduler(config, max_seq_len, kv_capacity_tokens)


def test_scheduler_policy_picks_the_plugin_that_answers_it_and_an_unknown_one_is_refused(fake: Any) -> None:
    plugin = _LastFirst()
    _plugins.get_registry().add_plugin(plugin, "lifo")
    with LLM("m", backend="fake", scheduler={"policy": "test-lifo"}) as llm:
        assert llm.generate("ab", {"max_tokens": 2})[0].outputs[0].token_ids
    assert plugin.asked == ["test-lifo"]
    with pytest.raises(ConfigError, match="scheduler.policy: no plugin provides scheduling policy 'nope'"):
        LLM("m", backend="fake", scheduler={"policy": "nope"})
    with LLM("m", backend="fake") as llm:  # the default, "fcfs": the built-in plugin's
        assert llm.model_config.scheduler.policy == "fcfs"
