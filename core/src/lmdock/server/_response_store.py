"""The Responses API's memory: the recent responses a server kept (``store``, the default), so that
``previous_response_id`` continues a conversation and ``GET /v1/responses/{id}`` reads one back.

Bounded in bytes and in count (``[server] response_store_max_bytes`` / ``response_store_max_items``),
least recently used first out: an unbounded store is memory a client can grow without end.

What is kept is what the API gives back, as compact JSON bytes, never the request's Python objects (a
body of small JSON objects costs about ten times its size as dicts and lists): the response body as
sent (for ``GET``) and the conversation it ends, one bytes object per chat message.  A new turn
shares its history's messages with the response it continued (a tuple of pointers to the same
bytes, not a copy), and each stored response counts its whole history's bytes, so the bound
overcounts shared messages and holds memory under it.  In memory only: a restart forgets every response.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: Responses a server keeps by default (``[server] response_store_max_items``).
MAX_STORED = 1024
#: Bytes of stored JSON a server keeps by default (``[server] response_store_max_bytes``: 128 MiB).
MAX_STORED_BYTES = 134_217_728


def packed(value: Any) -> bytes:
    """``value`` as compact JSON bytes (what a stored response keeps)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Stored:
    """One kept response: its body as sent, and the conversation it ends (chat messages, without the
    request's ``instructions``, which the next request does not inherit), each as JSON bytes."""

    body: bytes
    messages: tuple[bytes, ...]

    @classmethod
    def of(cls, response: dict[str, Any], previous: tuple[bytes, ...], new: list[dict[str, Any]]) -> Stored:
        """A response continuing ``previous`` (shared, not copied) with ``new`` messages."""
        return cls(packed(response), (*previous, *(packed(m) for m in new)))

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(m) for m in self.messages)

    @property
    def response(self) -> dict[str, Any]:
        return json.loads(self.body)  # type: ignore[no-any-return]

    def history(self) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.messages]


class ResponseStore:
    """At most ``limit`` responses and ``max_bytes`` of them by id, least recently used first out;
    a response larger than ``max_bytes`` alone is not kept."""

    def __init__(self, limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.bytes = 0
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        found = self.items.get(response_id)
        if found is not None:
            self.items.move_to_end(response_id)
        return found

    def put(self, response_id: str, stored: Stored) -> bool:
        """Keep ``stored`` (dropping the least recently used to make room); False when it alone is
        past the bound and was not kept."""
        self.delete(response_id)
        if stored.size > self.max_bytes or self.limit < 1:
            return False
        self.items[response_id] = stored
        self.bytes += stored.size
        while len(self.items) > self.limit or self.bytes > self.max_bytes:
            _, gone = self.items.popitem(last=False)
            self.bytes -= gone.size
        return True

    def delete(self, response_id: str) -> bool:
        gone = self.items.pop(response_id, None)
        if gone is None:
            return False
        self.bytes -= gone.size
        return True
