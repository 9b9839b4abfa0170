"""Stop strings (lmdock._engine.stops): the same answer as a plain search, with work that follows the
new text and not the number of stop strings (issue 28)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdock import LLM, SamplingParams
from lmdock._engine import stops as stops_module
from lmdock._engine.stops import StopStrings


def plain_search(stops: list[str], text: str, new_chars: int, include: bool) -> tuple[str, str] | None:
    """The reference: every stop string searched in the window the new characters can complete
    (vLLM's check_stop_strings); the earliest start wins, then the first in the list."""
    best = None
    for index, stop in enumerate(stops):
        i = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if i >= 0 and (best is None or (i, index) < best):
            best = (i, index)
    if best is None:
        return None
    i, index = best
    return (text[: i + len(stops[index])] if include else text[:i]), stops[index]


alphabet = st.sampled_from("abc ")
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=6)
pieces = st.lists(st.text(alphabet, min_size=1, max_size=3), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(stop_lists, pieces, st.booleans(), st.integers(0, 4))
def test_streamed_matching_equals_a_plain_search(stops: list[str], chunks: list[str], include: bool, quiet: int) -> None:
    """Text arrives in random pieces; the first ``quiet`` pieces are not searched (min_new_tokens)."""
    finder = StopStrings(stops, include)
    text = ""
    for k, piece in enumerate(chunks):
        text += piece
        if k < quiet:
            continue
        got = finder.find(text, len(piece))
        want = plain_search(stops, text, len(piece), include)
        assert got == want, (stops, chunks, k)
        if want is not None:
            break


def test_a_fork_keeps_its_own_place() -> None:
    parent = StopStrings(["abc"], False)
    assert parent.find("ab", 2) is None
    child = parent.copy()
    assert child.find("abX", 1) is None  # the child went another way
    assert parent.find("abc", 1) == ("", "abc")


def test_text_that_was_rewritten_is_searched_again() -> None:
    finder = StopStrings(["xy"], False)
    assert finder.find("aaax", 4) is None
    assert finder.find("ax", 2) is None  # shorter than what was read: the window is read again
    assert finder.find("axy", 1) == ("a", "xy")


def test_work_per_character_does_not_grow_with_the_number_of_stop_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = []
    real = stops_module._Automaton.step

    def counting(self: object, state: int, ch: str) -> int:
        steps.append(ch)
        return real(self, state, ch)  # type: ignore[arg-type]

    monkeypatch.setattr(stops_module._Automaton, "step", counting)
    text = "".join(chr(ord("a") + i % 26) for i in range(300))
    for count in (1, 10_000):
        steps.clear()
        finder = StopStrings([f"zz{i}q" for i in range(count)], False)
        for end in range(10, 301, 10):
            assert finder.find(text[:end], 10) is None
        assert len(steps) == 300, count  # one transition per character read, for 1 or 10,000 stops


def test_many_stop_strings_through_the_engine(fake: object) -> None:
    """10,000 stop strings on the FAKE engine: the one that occurs stops the text where it should."""
    with LLM("m", backend="fake") as llm:
        plain = llm.generate("ab", SamplingParams(temperature=0, max_new_tokens=12, detokenize=True))[0].outputs[0].text
        assert len(plain) > 4
        target = plain[2:4]
        stops = [f"never-{i}" for i in range(10_000)] + [target]
        out = llm.generate("ab", SamplingParams(temperature=0, max_new_tokens=12, stop=stops))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.text == plain[: plain.index(target)]
