"""The Responses API's memory: the last :data:`MAX_STORED` responses a server kept (``store``, the
default), so that ``previous_response_id`` continues a conversation and ``GET /v1/responses/{id}``
reads one back.

Bounded, least recently used first out: an unbounded store is memory a client can grow without end.
A response keeps its whole conversation as a tuple of chat messages; the messages themselves are
shared with the response it continued (a new turn adds a tuple of pointers and its own messages,
not a copy of the history).  In memory only: a restart forgets every response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: Responses a server keeps; the least recently used one goes first (``docs/server.md``).
MAX_STORED = 1024


@dataclass(frozen=True, slots=True)
class Stored:
    """One kept response: its body as sent, and the conversation it ends (chat messages, without the
    request's ``instructions``, which the next request does not inherit)."""

    response: dict[str, Any]
    history: tuple[dict[str, Any], ...]


class ResponseStore:
    """At most ``limit`` responses by id, least recently used first out."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        found = self.items.get(response_id)
        if found is not None:
            self.items.move_to_end(response_id)
        return found

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        self.items.move_to_end(response_id)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self.items.pop(response_id, None) is not None
