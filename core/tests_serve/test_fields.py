"""OpenAI's and vLLM's request fields that bias, restrict or constrain the output, against a real
``lmdock serve`` (stories260K on hf): each honoured as documented, with the official ``openai``
client (vLLM's extras through ``extra_body``) and with raw HTTP, or refused with a 400 naming it.

Greedy decoding of "Once upon a time" is the documented text (``serve_helpers.DOCUMENTED``), whose
first token is 432 (",") and whose next tokens are 383 (" there"), 286 (" was"), 261 (" a")."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import DOCUMENTED, Server

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": PROMPT}]  # the test template renders "<s>Once upon a time", as the completion


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def complete(server: Server, max_tokens: int = 40, **extra: Any) -> Any:
    """A greedy completion with the openai client; lmdock's and vLLM's own fields go in extra_body."""
    return client(server).completions.create(model="stories", prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=extra).choices[0]


def chat_raw(server: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      json={"model": "stories", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **body})


def chat_text(server: Server, **body: Any) -> str:
    r = chat_raw(server, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def refused(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# -- logit_bias, allowed_token_ids, bad_words -------------------------------------------------


def test_logit_bias_minus_100_bans_the_first_greedy_token(server: Server) -> None:
    # OpenAI's own field (token ids as the object's keys), with the openai client
    r = client(server).chat.completions.create(model="stories", messages=MESSAGES, max_tokens=40, temperature=0,  # type: ignore[arg-type]
                                               logit_bias={"432": -100})
    text = r.choices[0].message.content
    assert text != DOCUMENTED and "," not in text and text.startswith(" there was a little girl")
    assert complete(server, logit_bias={"432": -100}).text == text  # completions too
    assert chat_text(server, logit_bias={"432": -100}) == text  # raw HTTP


def test_logit_bias_plus_100_makes_a_token_the_greedy_choice(server: Server) -> None:
    assert complete(server, max_tokens=6, logit_bias={"383": 100}).text == " there" * 6
    assert chat_text(server, max_tokens=6, logit_bias={"383": 100}) == " there" * 6


def test_allowed_token_ids_restrict_every_token(server: Server) -> None:
    words = {"there", "was", "a"}  # tokens 383, 286, 261
    greedy = complete(server, allowed_token_ids=[383, 286, 261])
    sampled = client(server).completions.create(model="stories", prompt=PROMPT, max_tokens=30, temperature=1.0, seed=5, n=3,
                                                extra_body={"allowed_token_ids": [383, 286, 261]})
    for text in [greedy.text, *(c.text for c in sampled.choices)]:
        assert text and set(text.split()) <= words, text
    assert set(chat_text(server, allowed_token_ids=[383, 286, 261]).split()) <= words


def test_bad_words_never_appear(server: Server) -> None:
    for text in (complete(server, bad_words=["Lily", "park"]).text, chat_text(server, bad_words=["Lily", "park"])):
        assert text != DOCUMENTED and "Lily" not in text and "park" not in text, text


@pytest.mark.parametrize(("body", "field"), [
    ({"logit_bias": {"432": 150}}, "logit_bias"),  # OpenAI's range is [-100, 100]
    ({"logit_bias": {"comma": -100}}, "logit_bias"),  # keys are token ids
    ({"logit_bias": {"99999": -100}}, "logit_bias"),  # outside the vocabulary (512)
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, 99999]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
])
def test_a_bad_value_is_400_naming_the_field(server: Server, body: dict[str, Any], field: str) -> None:
    err = refused(chat_raw(server, **body))
    assert field in err["message"], err
    with pytest.raises(openai.BadRequestError, match=field):
        complete(server, **body)


# -- vLLM's guided decoding and structured_outputs ----------------------------------------------


def test_guided_choice_returns_one_of_the_choices(server: Server) -> None:
    choices = ["yes", "no", "once upon a time"]
    assert complete(server, guided_choice=choices).text in choices
    assert chat_text(server, guided_choice=choices) in choices
    assert complete(server, structured_outputs={"choice": choices}).text in choices


def test_guided_regex_matches(server: Server) -> None:
    pattern = r"[a-z]+ [a-z]+\."
    assert re.fullmatch(pattern, complete(server, guided_regex=pattern).text)
    assert re.fullmatch(pattern, chat_text(server, structured_outputs={"regex": pattern}))


def test_guided_grammar_and_guided_json(server: Server) -> None:
    assert complete(server, guided_grammar='start: "The " ("cat" | "dog") "."').text in ("The cat.", "The dog.")
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["pet", "legs"], "additionalProperties": False}
    for text in (complete(server, max_tokens=60, guided_json=schema).text, chat_text(server, max_tokens=60, guided_json=json.dumps(schema)),
                 chat_text(server, max_tokens=60, structured_outputs={"json": schema})):
        jsonschema.validate(json.loads(text), schema)
    assert complete(server, max_tokens=8, structured_outputs={"json_object": True}).text.startswith("{")  # any object


@pytest.mark.parametrize(("body", "named"), [
    ({"guided_choice": ["a", "b"], "guided_regex": "[ab]"}, ("guided_choice", "guided_regex")),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}}, ("guided_json", "structured_outputs")),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, ("guided_regex", "response_format")),
])
def test_two_constraints_at_once_are_400_naming_both(server: Server, body: dict[str, Any], named: tuple[str, str]) -> None:
    err = refused(chat_raw(server, **body))
    assert all(n in err["message"] for n in named) and err["param"] in named


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),  # one kind at a time
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),  # not honoured: refused
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_what_structured_output_does_not_honour_is_400_naming_it(server: Server, body: dict[str, Any], param: str) -> None:
    err = refused(httpx.post(f"{server.url}/v1/completions", json={"model": "stories", "prompt": PROMPT, **body}, timeout=60))
    assert err["param"] == param


# -- OpenAI's strict JSON schema ----------------------------------------------------------------


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_strict_json_schema_allows_no_other_keys_and_requires_every_one(server: Server) -> None:
    """``strict: true`` is OpenAI's strict mode: the schema as if every object said
    ``additionalProperties: false`` and required all its properties; the output validates against
    that schema (written out here) and so against the one sent."""
    r = client(server).chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=60, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    data = json.loads(choice.message.content)
    strict = {**SCHEMA, "additionalProperties": False, "required": ["name", "age"]}
    jsonschema.validate(data, strict)
    jsonschema.validate(data, SCHEMA)
    assert set(data) == {"name", "age"}



def test_json_schema_without_strict_closes_unlisted_keys_and_bounds_numbers(server: Server) -> None:
    """Without ``strict``, the schema as given, with what it leaves open bounded as vLLM's default
    backend bounds it (docs/structured-output.md): an object that lists its properties takes no
    others unless it says ``additionalProperties``; an unbounded integer stays in ±(2**53 - 1)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}

    def ask(s: dict[str, Any]) -> Any:
        return client(server).chat.completions.create(
            model="stories", messages=[{"role": "user", "content": "Lily"}], max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": s}}).choices[0]  # type: ignore[arg-type,call-overload]

    closed = ask(schema)
    assert closed.finish_reason == "stop", closed
    data = json.loads(closed.message.content)
    jsonschema.validate(data, schema)
    assert set(data) <= {"name", "age"}
    assert abs(data.get("age", 0)) <= 2**53 - 1
    # an explicit additionalProperties: true is honoured as written: this model then writes a key of its own
    opened = ask({**schema, "additionalProperties": True}).message.content
    assert opened.startswith('{"') and not opened.startswith(('{"name"', '{"age"')), opened
