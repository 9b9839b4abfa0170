"""``RequestStream``: the one stream every reader of a request uses (``LLM.stream`` and
``stream_generate``, a streaming ``RequestFuture``, ``lmdock serve``).  Fed here by hand (a thread
standing for the engine's); the readers over a real engine are tested where they are used."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from lmdock import CompletionOutput, EngineClosedError, RequestError, RequestOutput
from lmdock._llm.streams import RequestStream


def snapshot(k: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1], [CompletionOutput(0, "x" * k, list(range(k)))], finished)


def fed(merge: bool, skipped: list[RequestOutput] | None = None) -> tuple[RequestStream, list[str]]:
    aborted: list[str] = []
    stream = RequestStream("r", aborted.append, merge=merge, skipped=None if skipped is None else skipped.append)
    for k in range(1, 4):
        stream.put(snapshot(k))
    stream.put(snapshot(4, finished=True))
    return stream, aborted


async def read_all(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


def test_snapshots_that_wait_are_merged_into_the_newest_where_merging() -> None:
    skipped: list[RequestOutput] = []
    stream, aborted = fed(merge=True, skipped=skipped)
    outs = asyncio.run(read_all(stream))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] and outs[0].finished
    assert [len(o.outputs[0].token_ids) for o in skipped] == [1, 2, 3]  # each merged one still seen
    assert aborted == []  # read to its end: nothing to abort


def test_without_merging_every_snapshot_is_read_sync_and_async() -> None:
    stream, aborted = fed(merge=False)
    assert [len(o.outputs[0].token_ids) for o in asyncio.run(read_all(stream))] == [1, 2, 3, 4]
    stream, aborted = fed(merge=False)
    assert [len(o.outputs[0].token_ids) for o in stream] == [1, 2, 3, 4] and aborted == []


def test_leaving_early_aborts_once() -> None:
    stream, aborted = fed(merge=False)
    for _ in stream:
        break
    assert aborted == ["r"]
    stream.close()
    assert aborted == ["r"]

    async def first_only(stream: RequestStream) -> None:
        async for _ in stream:
            break

    stream, aborted = fed(merge=False)
    asyncio.run(first_only(stream))
    assert aborted == ["r"]


def test_an_error_reaches_the_reader_even_behind_merged_snapshots() -> None:
    aborted: list[str] = []
    stream = RequestStream("r", aborted.append, merge=True)
    stream.put(snapshot(1))
    stream.fail(RequestError("bad prompt"))
    with pytest.raises(RequestError, match="bad prompt"):
        asyncio.run(read_all(stream))


def test_outputs_from_another_thread_wake_an_async_reader() -> None:
    stream = RequestStream("r", lambda rid: None)

    def engine() -> None:
        for k in range(1, 6):
            time.sleep(0.01)
            stream.put(snapshot(k, finished=k == 5))

    async def main() -> list[RequestOutput]:
        threading.Thread(target=engine).start()
        return await asyncio.wait_for(read_all(stream), 30)

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5


def test_a_synchronous_reader_stops_waiting_once_the_llm_is_shut_down() -> None:
    alive = [True]
    stream = RequestStream("r", lambda rid: None, alive=lambda: alive[0])
    stream.put(snapshot(1))
    reader = iter(stream)
    assert next(reader).outputs[0].text == "x"
    alive[0] = False
    with pytest.raises(EngineClosedError, match="shut down"):
        next(reader)
