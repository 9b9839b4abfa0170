"""Stop strings: the first one in generated text, across token boundaries, in time that follows the
new text, not the number of stop strings.

A request's stop strings become one Aho-Corasick automaton (built once per distinct list and shared
by every sequence that uses it); each sequence keeps only its place in it.  Each new character is
one transition, so 10,000 stop strings cost what one does per generated character (issue 28: a
search per stop string per token made such a request 4x slower and its neighbours 14x).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence


class _Automaton:
    """Aho-Corasick over the stop strings: ``goto`` per state, failure links, and for each state the
    longest stop string that ends there (``best``: (length, index in the list), or None)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.best: list[tuple[int, int] | None] = [None]
        for index, stop in enumerate(stops):
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.best.append(None)
                state = nxt
            if self.best[state] is None:  # a repeated stop string keeps its first index
                self.best[state] = (len(stop), index)
        self.fail = [0] * len(self.goto)
        self._link()

    def _link(self) -> None:
        """Failure links breadth-first; a state with no stop string of its own ending there takes
        the longest one its failure state has (a proper suffix of it)."""
        todo = deque(self.goto[0].values())
        while todo:
            state = todo.popleft()
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[nxt] = self.goto[f].get(ch, 0) if self.goto[f].get(ch, 0) != nxt else 0
                if self.best[nxt] is None:
                    self.best[nxt] = self.best[self.fail[nxt]]
                todo.append(nxt)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


@functools.lru_cache(maxsize=64)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    return _Automaton(stops)


class StopStrings:
    """Finds the first stop string in one sequence's generated text, across token boundaries."""

    def __init__(self, stops: Sequence[str], include_in_output: bool) -> None:
        self.stops = tuple(stops)
        self.include = include_in_output
        #: Characters held back from a stream: they might be the start of a stop string.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self._auto = _automaton(self.stops) if self.stops else None
        self._state = 0
        self._fed = 0  # characters of the text the automaton has read

    def copy(self) -> StopStrings:
        """This sequence's place, for a forked sequence (the automaton is shared)."""
        twin = object.__new__(StopStrings)
        twin.__dict__.update(self.__dict__)
        return twin

    def find(self, text: str, new_chars: int) -> tuple[str, str] | None:
        """The first stop string that the last ``new_chars`` characters of ``text`` complete.

        Text before those characters that was not searched (``min_new_tokens`` not reached yet) is
        read without reporting.  Among stop strings completed by this call, the one that starts
        first wins, and of those the first in the list.

        :return: ``(text cut at the stop string, the stop string)`` or None.
        """
        if self._auto is None or new_chars == 0:
            return None
        report_from = len(text) - new_chars
        if self._fed > report_from:  # the text is not the one read so far: read the window again
            self._state, self._fed = 0, max(0, report_from - self.holdback)
        auto, state, hit = self._auto, self._state, None
        for pos in range(self._fed, len(text)):
            state = auto.step(state, text[pos])
            best = auto.best[state]
            if best is not None and pos >= report_from:
                start = pos + 1 - best[0]
                if hit is None or (start, best[1]) < hit:
                    hit = (start, best[1])
        self._state, self._fed = state, len(text)
        if hit is None:
            return None
        start, index = hit
        stop = self.stops[index]
        return (text[: start + len(stop)] if self.include else text[:start]), stop
