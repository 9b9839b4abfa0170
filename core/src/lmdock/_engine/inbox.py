"""The loop's inbox: typed messages from any thread, and the closing or dead state that refuses them.

Callers post :class:`Add`, :class:`Abort`, :class:`Query` and :class:`ClearCache`; the loop takes them
all at once each iteration.  When the loop stops, each message still waiting is refused with the
error (:meth:`Message.refuse`), so nothing waits forever.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from lmdock._engine.failures import settle_future
from lmdock._llm.streams import safe_fail
from lmdock._plugin.errors import EngineClosedError

if TYPE_CHECKING:
    import numpy as np

    from lmdock._engine.sampler import LogitsProcessor
    from lmdock._plugin.contract import EngineRequest, OutputSink


@dataclass(frozen=True)
class Add:
    """A request, checked and compiled in the caller's thread (``submit``)."""

    request: EngineRequest
    sink: OutputSink
    processors: Sequence[LogitsProcessor]
    constraints: Sequence[Any] | None
    #: the token sequences of ``params.bad_words`` (``lmdock._engine.biases.bad_words_ids``)
    bad_words: Sequence[Sequence[int]] = ()

    def refuse(self, error: BaseException) -> None:
        safe_fail(self.sink, error)


@dataclass(frozen=True)
class Abort:
    request_id: str

    def refuse(self, error: BaseException) -> None:
        pass  # nobody waits on an abort


@dataclass(frozen=True)
class Query:
    """A next-token-logprobs query."""

    token_ids: list[int]
    future: concurrent.futures.Future[np.ndarray]

    def refuse(self, error: BaseException) -> None:
        settle_future(self.future, error=error)


@dataclass(frozen=True)
class ClearCache:
    done: concurrent.futures.Future[None]

    def refuse(self, error: BaseException) -> None:
        settle_future(self.done, error=error)


Message: TypeAlias = "Add | Abort | Query | ClearCache"


class Inbox:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._messages: deque[Message] = deque()
        self.closing = False
        #: the error the engine died of: new messages are refused with it
        self.dead: BaseException | None = None

    def post(self, message: Message) -> None:
        """Queue a message; refused at once when the loop is dead or shutting down."""
        with self._cv:
            if self.dead is not None:
                raise EngineClosedError(f"the engine is dead: {self.dead}")
            if self.closing:
                raise EngineClosedError("this LLM was shut down; create a new one")
            self._messages.append(message)
            self._cv.notify()

    def post_abort(self, message: Abort) -> None:
        """Queue an abort; dropped while shutting down (shutdown fails whatever is in flight)."""
        with self._cv:
            if self.closing:
                return
            self._messages.append(message)
            self._cv.notify()

    def shut_down(self) -> None:
        with self._cv:
            self.closing = True
            self._cv.notify()

    def wait(self, has_work: Callable[[], bool]) -> tuple[deque[Message], bool]:
        """Wait until there is a message, work, or a shutdown; take every message.  ``(messages, closing)``."""
        with self._cv:
            while not self._messages and not has_work() and not self.closing:
                self._cv.wait()
            messages, self._messages = self._messages, deque()
            return messages, self.closing

    def close(self, error: BaseException, dead: bool) -> deque[Message]:
        """Refuse new messages from now on (with ``error`` where ``dead``); the ones waiting, to refuse."""
        with self._cv:
            self.closing = True
            if dead:
                self.dead = error
            messages, self._messages = self._messages, deque()
            return messages
