"""Tokenizers as real models ship them: a Qwen2.5-style tokenizer (``qwen_like``), whose ``<tool_call>``
is an added token that is not special, gets schema-valid calls under a forced ``tool_choice`` on every
API, through a real ``lmdock serve`` (hf, loopback); and the lazy grammar under ``auto`` lets the token
through.  Checked against ``jsonschema``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
from qwen_like import cached
from serve_helpers import Server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
ASK = [{"role": "user", "content": "The weather in Paris?"}]


@pytest.fixture(scope="module")
def model() -> Path:
    return cached()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Server]:
    qwen = (f'[models.qwen]\nmodel = "{model}"\nbackend = "hf"\ntool_parser = "hermes"\n'
            '[models.qwen.sampling]\ntemperature = 0.0\nmax_new_tokens = 80\n[models.qwen.backends.hf]\nnum_threads = 1\n')
    s = Server(tmp_path_factory.mktemp("qwen"), args=("--model", "qwen"), extra_models=qwen)
    yield s
    s.stop()


def test_the_tool_tokens_are_added_and_not_special(model: Path) -> None:
    added = {a["content"]: a["special"] for a in json.loads((model / "tokenizer.json").read_text())["added_tokens"]}
    assert added["<tool_call>"] is False and added["</tool_call>"] is False and added["<|im_end|>"] is True


def test_a_forced_call_is_schema_valid_on_every_api(served: Server) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=120, json={
        "model": "qwen", "messages": ASK, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    r = httpx.post(f"{served.url}/v1/messages", timeout=120, json={
        "model": "qwen", "max_tokens": 80, "messages": ASK, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}]})
    assert r.status_code == 200, r.text
    (use,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    jsonschema.validate(use["input"], SCHEMA)
    assert r.json()["stop_reason"] == "tool_use"
    r = httpx.post(f"{served.url}/v1/responses", timeout=120, json={
        "model": "qwen", "input": ASK[0]["content"], "tool_choice": "required", "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]})
    assert r.status_code == 200, r.text
    (item,) = [i for i in r.json()["output"] if i["type"] == "function_call"]
    jsonschema.validate(json.loads(item["arguments"]), SCHEMA)


def test_the_lazy_grammar_lets_the_added_token_through(model: Path) -> None:
    """Under ``auto`` the call grammar waits for ``<tool_call>``: the one token that spells it must be allowed."""
    from lmdock import SamplingParams
    from lmdock._engine.structured import ConstraintFactory
    from lmdock.tools import ChatPlan
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    plan = ChatPlan.make(tools, "auto", None, None, model="qwen", tool_parser="hermes", reasoning_parser=None, template=None)
    so = plan.constraint((True, ""), None, "hf")
    factory = ConstraintFactory(tok, len(tok), (tok.convert_tokens_to_ids("<|im_end|>"),))
    (c,) = factory(SamplingParams(structured_output=so), 1)
    row = np.zeros(len(tok), dtype=bool)
    c.allowed(row)
    assert row[tok.convert_tokens_to_ids("<tool_call>")]
    c.accept(tok.convert_tokens_to_ids("<tool_call>"))
    row[:] = False
    c.allowed(row)
    assert not row[tok.convert_tokens_to_ids("<|im_start|>")]  # inside the call: JSON only


def test_the_byte_level_spelling_is_the_tokenizers_librarys() -> None:
    from lmdock._engine.llg_vocab import _byte_chars
    from tokenizers import pre_tokenizers

    ((piece, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(" é<")
    assert piece == "".join(_byte_chars()[b] for b in " é<".encode())
