"""What goes wrong with one request, and how it reaches whoever waits.

Helpers of the loop (contained sampling, constraint masks, beam steps, deferred output work) never
end a request themselves: they return :data:`Failure` pairs, ``(sequence, error)``, and the loop
fails those requests (``Requests.fail``).  So no helper calls back into the runner, and a failure
is acted on in one place.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from lmdock._plugin.errors import LmdockError, RequestError

if TYPE_CHECKING:
    from lmdock._engine.sequence import QuerySeq, Seq

#: A sequence whose request (or query) must fail, and the error that names the cause.
Failure: TypeAlias = "tuple[Seq | QuerySeq, LmdockError]"


def as_request_error(exc: BaseException, what: str) -> LmdockError:
    """``exc`` as the error one request fails with: an lmdock error as it is, anything else named
    after the phase that raised it (``"sampling failed: ValueError: ..."``)."""
    if isinstance(exc, LmdockError):
        return exc
    error = RequestError(f"{what} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def guard(seq: Seq | QuerySeq, what: str, fn: Callable[..., Any], *args: Any) -> Failure | None:
    """Call ``fn(*args)`` for ``seq``; what it raises comes back as the sequence's failure."""
    try:
        fn(*args)
    except Exception as exc:
        return seq, as_request_error(exc, what)
    return None


def settle_future(fut: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    """Give a waiter its result or error; one cancelled by its caller meanwhile is left alone."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
