"""The official ``openai`` client against a running ``lmdock serve`` (stories260K on hf, loopback)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import DOCUMENTED, PROMPT_IDS, Server


def client(server: Server, **kw: object) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=f"{server.url}/v1", **kw)  # type: ignore[arg-type]


def test_models_lists_the_config_name(server: Server) -> None:
    ids = [m.id for m in client(server).models.list().data]
    assert ids == ["stories"]


def test_models_retrieve_one_by_name_or_404(server: Server) -> None:
    model = client(server).models.retrieve("stories")
    assert model.id == "stories" and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(server).models.retrieve("nope")


def test_greedy_completion_is_the_documented_continuation(server: Server) -> None:
    """``POST /v1/completions`` through the openai client: the greedy text of ../shared/models/README.md."""
    r = client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.choices[0].text == DOCUMENTED
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 40)


def test_token_id_prompts(server: Server) -> None:
    c = client(server)
    # token ids go in as they are (no BOS added): these are "Once upon a time" with BOS
    r = c.completions.create(model="stories", prompt=PROMPT_IDS, max_tokens=40, temperature=0)
    assert r.choices[0].text == DOCUMENTED
    r2 = c.completions.create(model="stories", prompt=[PROMPT_IDS, PROMPT_IDS[:3]], max_tokens=8, temperature=0)
    assert [ch.index for ch in r2.choices] == [0, 1]
    assert r2.choices[0].text == r.choices[0].text[: len(r2.choices[0].text)]
    assert r2.usage.prompt_tokens == 8


def test_streamed_chunks_join_to_the_text(server: Server) -> None:
    c = client(server)
    chunks = list(c.completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == DOCUMENTED
    assert len([ch for ch in chunks if ch.choices]) > 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]


def test_n_2_gives_two_choices(server: Server) -> None:
    r = client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert all(ch.text for ch in r.choices)
    assert 2 <= r.usage.completion_tokens <= 24


def test_logprobs_of_the_greedy_tokens_are_the_top_ones(server: Server) -> None:
    r = client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert "".join(lp.tokens).replace(" ", "") == r.choices[0].text.replace(" ", "")
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 3
        assert chosen == pytest.approx(max(top.values()))
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_logprobs_gives_the_prompt_logprobs(server: Server) -> None:
    r = client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=1, temperature=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text.startswith("Once upon a time")
    lp = ch.logprobs
    assert len(lp.token_logprobs) == 5 + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])


def test_chat_through_an_explicit_template(server: Server) -> None:
    """``POST /v1/chat/completions`` through the openai client, over the served template."""
    # the served template is "{{ bos_token }}" + the messages' contents
    toks = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Once upon a time"}]}).json()
    assert toks["tokens"][0] == 1
    r = client(server).chat.completions.create(model="stories", messages=[{"role": "user", "content": "Once upon a time"}],
                                               max_tokens=40, temperature=0, logprobs=True, top_logprobs=2)
    plain = client(server).completions.create(model="stories", prompt=toks["tokens"], max_tokens=40, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == plain.choices[0].text
    content = r.choices[0].logprobs.content
    assert len(content) == 40 and all(len(t.top_logprobs) == 2 for t in content)
    stream = client(server).chat.completions.create(model="stories", messages=[{"role": "user", "content": "Once upon a time"}],
                                                    max_tokens=40, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == plain.choices[0].text


def test_tokenize_detokenize_and_tokenizer_info(server: Server) -> None:
    toks = httpx.post(f"{server.url}/tokenize", json={"model": "stories", "prompt": "Once upon a time"}).json()
    assert toks["tokens"] == PROMPT_IDS and toks["count"] == 5 and toks["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"model": "stories", "tokens": PROMPT_IDS[1:]}).json()
    assert text["prompt"] == "Once upon a time"
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token_id"] == 2 and info["bos_token_id"] == 1


def test_metrics_use_vllm_names_under_the_lmdock_prefix(server: Server) -> None:
    client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=4, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "num_preemptions_total", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f"lmdock:{name}" in text, name
    assert 'lmdock:request_success_total{finished_reason="length",model_name="stories"}' in text


# -- errors: OpenAI's body on every status ----------------------------------------------------------


def _shape(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    return err


def test_unknown_model_is_404_listing_the_served(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client(server).completions.create(model="nope", prompt="hi", max_tokens=2)
    err = _shape(exc.value.response.json())
    assert "stories" in err["message"] and err["param"] == "model"


def test_bad_json_and_bad_fields_are_400(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    _shape(r.json())
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "stories"})
    assert r.status_code == 400 and "prompt" in _shape(r.json())["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client(server).completions.create(model="stories", prompt="hi", temperature=-1)
    assert "temperature" in _shape(exc.value.response.json())["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client(server).completions.create(model="stories", prompt=[99999], max_tokens=2)
    assert "vocabulary" in _shape(exc.value.response.json())["message"]
    with pytest.raises(openai.BadRequestError) as exc:  # a schema llguidance cannot compile fails alone
        client(server).chat.completions.create(model="stories", messages=[{"role": "user", "content": "x"}],
                                               response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "structured_output" in _shape(exc.value.response.json())["message"]
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404
    _shape(r.json())


def test_missing_or_wrong_key_is_401_and_health_needs_none(strict: Server) -> None:
    """The key is the first line of ``[server] api_key_file`` (the ``strict`` server's, with
    ``$LMDOCK_API_KEY`` unset)."""
    assert httpx.get(f"{strict.url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError) as exc:
        client(strict).models.list()
    _shape(exc.value.response.json())
    r = httpx.get(f"{strict.url}/v1/models")
    assert r.status_code == 401 and "missing" in _shape(r.json())["message"]
    assert [m.id for m in client(strict, api_key="sekret-key").models.list().data] == ["stories"]


def test_oversized_body_is_413(strict: Server) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client(strict, api_key="sekret-key").completions.create(model="stories", prompt="x" * 5000, max_tokens=2)
    assert exc.value.status_code == 413
    _shape(exc.value.response.json())
    # chunked, without a Content-Length: counted as it arrives
    r = httpx.post(f"{strict.url}/v1/completions", headers={"authorization": "Bearer sekret-key", "content-type": "application/json"},
                   content=iter([json.dumps({"prompt": "x" * 5000}).encode()]))
    assert r.status_code == 413
    _shape(r.json())


def test_full_queue_is_429_with_retry_after_and_the_client_retry_honours_it(strict: Server) -> None:
    """The 429's ``Retry-After`` is ``[server] retry_after`` (1 s by default)."""
    import threading

    headers = {"authorization": "Bearer sekret-key"}
    seen: list[int] = []
    got_429 = threading.Event()

    def hook(response: httpx.Response) -> None:
        seen.append(response.status_code)
        if response.status_code == 429:
            got_429.set()

    # Everything but the two refused requests is made before the holder starts: the holder's 500
    # tokens are all the time there is (built inside it, the clients took up to a fifth of it here).
    refused = client(strict, api_key="sekret-key")
    retrying = client(strict, api_key="sekret-key", max_retries=3, http_client=httpx.Client(event_hooks={"response": [hook]}))
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(retrying.completions.create(model="stories", prompt="Once upon a time",
                                                                                      max_tokens=40, temperature=0)))
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{strict.url}/v1/completions", json=body, headers=headers) as holder:
        lines = holder.iter_lines()
        assert next(lines).startswith("data: ")  # the holder is in flight: the one queue place is taken
        with pytest.raises(openai.RateLimitError) as exc:
            refused.completions.create(model="stories", prompt="hi", max_tokens=2)
        t.start()
        assert got_429.wait(60)
    # the holder disconnected: its place is free before the client's retry (after Retry-After: 1 s)
    t.join(60)
    assert exc.value.response.headers["retry-after"] == "1"
    _shape(exc.value.response.json())
    assert seen[0] == 429 and seen[-1] == 200
    assert result and result[0].choices[0].text == DOCUMENTED  # type: ignore[attr-defined]


def test_response_format_constrains_the_reply(server: Server) -> None:
    """response_format maps onto structured_output (hf constrains through the core's llguidance stage)."""
    import json

    schema = {"type": "object", "properties": {"animal": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["animal", "legs"], "additionalProperties": False}
    out = client(server).chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    data = json.loads(choice.message.content)
    assert data["animal"] in ("cat", "dog") and 0 <= data["legs"] <= 8


def test_an_unknown_field_from_the_openai_client_is_400_naming_it(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(server).completions.create(model="stories", prompt="hi", max_tokens=2, extra_body={"ignore_eso": True})
    err = _shape(exc.value.response.json())
    assert err["param"] == "ignore_eso" and "did you mean 'ignore_eos'?" in err["message"]
    with pytest.raises(openai.BadRequestError) as exc:  # OpenAI's own field lmdock does not honour: refused, not dropped
        client(server).chat.completions.create(model="stories", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                               prediction={"type": "content", "content": "x"})
    assert _shape(exc.value.response.json())["param"] == "prediction"


def test_logprob_tokens_join_to_the_text_completions_and_chat_streamed_or_not(server: Server) -> None:
    """Each token's string is the text it adds (SentencePiece's leading spaces included), so they join
    to the completion, and chat's ``bytes`` are that text's UTF-8 (issue 29)."""
    c = client(server)
    r = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=24, temperature=0, logprobs=2)
    text = r.choices[0].text
    assert " " in text and "".join(r.choices[0].logprobs.tokens) == text
    offsets = r.choices[0].logprobs.text_offset
    assert [text[o:o + len(t)] for o, t in zip(offsets, r.choices[0].logprobs.tokens)] == r.choices[0].logprobs.tokens
    streamed_tokens, streamed_text = [], ""
    for chunk in c.completions.create(model="stories", prompt="Once upon a time", max_tokens=24, temperature=0, logprobs=2, stream=True):
        if chunk.choices:
            streamed_text += chunk.choices[0].text
            streamed_tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert streamed_text == text and "".join(streamed_tokens) == text
    messages = [{"role": "user", "content": "Once upon a time"}]
    ch = c.chat.completions.create(model="stories", messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    content = ch.choices[0].logprobs.content
    assert "".join(t.token for t in content) == ch.choices[0].message.content
    assert all(bytes(t.bytes) == t.token.encode() and len(t.top_logprobs) == 2 for t in content)
    pieces, said = [], ""
    for chunk in c.chat.completions.create(model="stories", messages=messages, max_tokens=24, temperature=0, logprobs=True, stream=True):
        if chunk.choices:
            said += chunk.choices[0].delta.content or ""
            pieces += [t.token for t in (chunk.choices[0].logprobs.content or [])] if chunk.choices[0].logprobs else []
    assert said == ch.choices[0].message.content and "".join(pieces) == said


def test_echo_with_max_tokens_0_scores_the_prompt(server: Server) -> None:
    """vLLM's prompt scoring: the prompt back with its logprobs and no completion (issue 29)."""
    r = client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == "Once upon a time" and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ch.logprobs.token_logprobs) == 5
    assert ch.logprobs.token_logprobs[0] is None and all(x < 0 for x in ch.logprobs.token_logprobs[1:])
    with_one = client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=1, echo=True, logprobs=1)
    assert with_one.choices[0].logprobs.token_logprobs[:5] == ch.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=0)
