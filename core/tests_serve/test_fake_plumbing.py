"""Plumbing of /v1/embeddings, /v1/score, /v1/rerank and the 500 path, against FakePoolingLLM.

FakePoolingLLM is a stand-in object (no model, no engine) with the interface ``LLM.embed`` /
``LLM.score`` promise: it tests only how the server maps requests and responses.  The real
embedding model is tested through these routes where LLM.embed exists.
"""

from __future__ import annotations

import base64
import functools
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from lmdock import ServerConfig
from lmdock.server import ServedModel, create_app


class _Backend:
    def __init__(self, name: str, supports: set[str]) -> None:
        self.name = name
        self._supports = supports

    def capability(self, cap: str) -> tuple[bool, str | None]:
        return (True, None) if cap in self._supports else (False, f"{self.name} has no {cap} (fake)")


class FakePoolingLLM:
    """Fake: embeds a text as [len(text), 1, 0], scores a pair by equal lengths."""

    def __init__(self, supports: set[str]) -> None:
        self.backend = _Backend("fakepool", supports)
        self.tokenizer = None
        self.max_model_len = 64
        self.model_config = SimpleNamespace(model="fake")
        self.calls: list[tuple[Any, ...]] = []

    def stats(self) -> dict[str, Any]:
        return {}

    def embed(self, inputs: list[Any], pooling_params: Any = None) -> list[Any]:
        self.calls.append(("embed", inputs, pooling_params))
        return [SimpleNamespace(outputs=SimpleNamespace(embedding=[float(len(x)), 1.0, 0.0]), prompt_token_ids=[0] * len(x))
                for x in inputs]

    def score(self, text_1: Any, text_2: Any) -> list[Any]:
        self.calls.append(("score", text_1, text_2))
        pairs = [(text_1, t) for t in text_2] if isinstance(text_1, str) else list(zip(text_1, text_2))
        return [SimpleNamespace(outputs=SimpleNamespace(score=1.0 / (1 + abs(len(a) - len(b)))), prompt_token_ids=[0] * (len(a) + len(b)))
                for a, b in pairs]

    def sampling_params(self, overrides: Any) -> Any:
        raise RuntimeError("boom: an unexpected failure inside the fake")


def _client(supports: set[str]) -> tuple[TestClient, FakePoolingLLM]:
    llm = FakePoolingLLM(supports)
    return TestClient(create_app([ServedModel("fake", llm, 4)], ServerConfig()), raise_server_exceptions=False), llm


def test_embeddings_float_and_base64() -> None:
    c, llm = _client({"embed"})
    r = c.post("/v1/embeddings", json={"model": "fake", "input": ["ab", "abcd"]})
    assert r.status_code == 200
    body = r.json()
    assert [d["embedding"] for d in body["data"]] == [[2.0, 1.0, 0.0], [4.0, 1.0, 0.0]]
    assert [d["index"] for d in body["data"]] == [0, 1] and body["usage"]["prompt_tokens"] == 6
    r = c.post("/v1/embeddings", json={"input": "abc", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert list(struct.unpack("<3f", raw)) == [3.0, 1.0, 0.0]
    assert llm.calls[-1][1] == ["abc"]


def test_embeddings_refused_with_the_backends_reason() -> None:
    c, _ = _client(set())
    r = c.post("/v1/embeddings", json={"input": "abc"})
    assert r.status_code == 400
    assert "fakepool has no embed (fake)" in r.json()["error"]["message"]


def test_score_and_rerank_shapes() -> None:
    c, _ = _client({"score"})
    r = c.post("/v1/score", json={"text_1": "abc", "text_2": ["abc", "a"]})
    assert [d["score"] for d in r.json()["data"]] == [1.0, pytest.approx(1 / 3)]
    r = c.post("/v1/rerank", json={"query": "abc", "documents": ["a", "abc", "ab"], "top_n": 2})
    results = r.json()["results"]
    assert [x["index"] for x in results] == [1, 2]
    assert results[0]["document"] == {"text": "abc"}
    r = c.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"


def test_an_unexpected_failure_is_500_without_a_traceback() -> None:
    c, _ = _client(set())
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert "Traceback" not in err["message"] and "boom" not in err["message"]


# -- streaming: snapshots that wait are merged ----------------------------------------------------


class FakeStreamingEngine:
    """Fake: on submit, posts five cumulative snapshots at once (as an engine ahead of the server's
    event loop does), one token of text each, the last one finished."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def submit(self, request: Any, sink: Any) -> None:
        from lmdock import CompletionOutput, RequestOutput

        for k in range(1, 6):
            done = k == 5
            c = CompletionOutput(0, "ab"[:1] * k, list(range(k)), finish_reason="length" if done else None)
            sink.put(RequestOutput(request.request_id, "p", [1], [c], done))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_snapshots_waiting_together_go_out_as_one() -> None:
    import asyncio

    from lmdock.server._engine_streams import engine_stream
    from lmdock.server._metrics import Metrics
    from lmdock.server._pool import ServedPool
    from lmdock.server._state import ServerState

    engine = FakeStreamingEngine()
    async def no_grammar(params: Any) -> None:  # the request has none to check
        pass

    from lmdock import LLM

    request = SimpleNamespace(request_id="r1", params=SimpleNamespace(structured_output=None), lora_request=None)
    llm = SimpleNamespace(engine=engine, acheck_grammar=no_grammar)
    llm.open_stream = functools.partial(LLM.open_stream, llm)  # the LLM's own, over the fake engine
    metrics = Metrics(lambda: {})
    state = ServerState(models={}, settings=ServerConfig(), api_key=None, metrics=metrics, pool=ServedPool({}, ServerConfig(), metrics))

    async def run() -> list[Any]:
        return [out async for out in engine_stream(state, SimpleNamespace(llm=llm, name="fake"), lambda: request, None)]

    outs = asyncio.run(run())
    # all five were queued before the first was taken: the newest (finished) one is the only one sent
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] and outs[0].finished
    assert engine.aborted == []  # it finished: nothing to abort
    assert state.metrics.generation_tokens.labels("fake")._value.get() == 5  # every token counted


# -- unknown fields: refused with a 400 naming them, as `lmdock batch` refuses them ----------------


@pytest.mark.parametrize(("route", "body", "param", "hint"), [
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, "max_token", "did you mean 'max_tokens'?"),
    ("/v1/chat/completions", {"messages": [], "temprature": 0}, "temprature", "did you mean 'temperature'?"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usag": True}},
     "stream_options.include_usag", "did you mean 'include_usage'?"),
    ("/v1/chat/completions", {"messages": [], "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs", "this request's fields: "),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "did you mean 'json'?"),
    ("/v1/embeddings", {"input": "abc", "encoding": "base64"}, "encoding", "did you mean 'encoding_format'?"),
    ("/tokenize", {"prompt": "abc", "add_special_token": False}, "add_special_token", "did you mean 'add_special_tokens'?"),
])
def test_an_unknown_field_is_400_naming_it(route: str, body: dict[str, Any], param: str, hint: str) -> None:
    c, llm = _client({"embed"})
    r = c.post(route, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and f"unknown field {param.rsplit('.', 1)[-1]!r}" in err["message"] and hint in err["message"]
    assert llm.calls == []  # refused before the model saw anything


def test_an_unknown_field_sent_as_null_asks_for_nothing() -> None:
    c, llm = _client({"embed"})
    r = c.post("/v1/embeddings", json={"input": "abc", "logit_bias": None})
    assert r.status_code == 200 and llm.calls[-1][1] == ["abc"]


def test_the_servers_sampling_fields_are_the_one_table() -> None:
    from lmdock._config.foreign import OPENAI_FIELDS
    from lmdock.server._protocol import ChatRequest, CompletionRequest

    for cls in (CompletionRequest, ChatRequest):
        assert set(OPENAI_FIELDS) <= set(cls.model_fields), cls.__name__
    body = CompletionRequest(prompt="x", max_tokens=3, max_completion_tokens=5, min_tokens=1, stop="a", top_k=2)
    assert body.overrides() == {"n": 1, "max_new_tokens": 5, "min_new_tokens": 1, "stop": ["a"], "top_k": 2}
