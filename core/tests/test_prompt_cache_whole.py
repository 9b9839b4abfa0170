"""Prefix caching for an engine whose state cannot be cut back (``fork_truncates = False``)."""

from __future__ import annotations

from lmdock._engine.prefix_cache import PromptCache


def test_whole_lookup_reuses_only_a_cached_prompt_the_new_one_extends() -> None:
    cache = PromptCache()
    cache.insert([1, 2, 3, 4, 5], seq_id=10)
    cache.insert([1, 2, 3], seq_id=11)
    # any shared prefix: the longest, whoever holds it
    assert cache.lookup([1, 2, 3, 4, 9]) == (10, 4)
    # whole prompts only: [1, 2, 3, 4, 5] is not all inside [1, 2, 3, 4, 9]; [1, 2, 3] is
    assert cache.lookup([1, 2, 3, 4, 9], whole=True) == (11, 3)
    assert cache.lookup([1, 2, 3, 4, 5, 6], whole=True) == (10, 5)
    assert cache.lookup([1, 2, 7], whole=True) == (None, 0)
