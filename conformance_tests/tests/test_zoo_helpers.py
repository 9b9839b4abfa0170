"""The family tests' own logic: a divergence at a near-tie is not a failure, any other is; a zoo that
was not built says how to build it (no torch needed to read one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lmdock_conformance.families import first_divergence
from lmdock_conformance.zoo import FORMAT, read

REF = {"tokens": [5, 6, 7, 8], "margins": [0.5, 0.0004, 0.3, 0.2]}


def test_equal_tokens_pass() -> None:
    assert first_divergence([5, 6, 7, 8], REF, 1e-3) is None


def test_a_divergence_at_a_tie_passes_and_one_past_a_clear_margin_fails() -> None:
    assert first_divergence([5, 9, 1, 1], REF, 1e-3) is None  # token 1's top-2 margin is 4e-4: either is greedy
    diff = first_divergence([5, 6, 9, 8], REF, 1e-3)
    assert diff is not None and diff.startswith("token 2: got 9, transformers 7 (top-2 margin 0.3000)")
    assert first_divergence([9, 6, 7, 8], REF, 1e-3) is not None


def test_missing_tokens_fail() -> None:
    assert "3 tokens, transformers 4" in (first_divergence([5, 6, 7], REF, 1e-3) or "")


def test_an_unbuilt_or_stale_zoo_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="python -m lmdock_conformance.zoo build"):
        read(tmp_path)
    (tmp_path / "zoo.json").write_text(json.dumps({"format": FORMAT + 1}))
    with pytest.raises(ValueError, match="rebuild it"):
        read(tmp_path)


def test_the_window_check_fails_a_window_that_changes_nothing() -> None:
    from lmdock_conformance.zoo import window_discriminates

    long = ["single", "a", "b", "c"]
    assert not window_discriminates("single", long, [])  # full attention gives the windowed tokens: gemma's case in issue 38
    assert not window_discriminates("single", long, ["a", "b", "c"])  # the longer-than-window test itself would pass
    assert not window_discriminates("single", long, ["single"])  # one prompt of four
    assert window_discriminates("single", long, ["single", "a"])
    assert window_discriminates("single", long, long)


def test_a_built_zoo_records_that_each_windowed_family_discriminates() -> None:
    """On the zoo CI built (LMDOCK_ZOO): every family with a window carries the builder's verdict."""
    import os

    folder = os.environ.get("LMDOCK_ZOO")
    if not folder:
        pytest.skip("LMDOCK_ZOO names no built zoo (scripts/test.sh sets it)")
    families = read(folder)["families"]
    for name in ("mistral", "qwen2_sliding", "phi3", "gemma2", "gemma3_text", "gpt_oss"):
        if name in families:
            seen = families[name].get("window_discriminates")
            assert seen and 2 * seen["differing"] >= seen["of"], f"{name}: {seen}"
