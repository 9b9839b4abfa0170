"""instructor's and LangChain's structured output against a real ``lmdock serve`` (stories260K on hf):
each returns a valid object of the Pydantic model it was given.

instructor's JSON_SCHEMA mode sends the model's JSON schema without ``strict`` and without
``additionalProperties``; LangChain sends ``strict: true`` and ``additionalProperties: false``. Both
leave ``age: int`` unbounded. lmdock closes the listed object and keeps the integer within
±(2**53 - 1) (docs/structured-output.md), so even this tiny model finishes the object within its
budget (without that, both end at the length limit: instructor's on keys and digits, LangChain's on
digits)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import instructor
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from serve_helpers import Server

MESSAGES = [{"role": "user", "content": "Lily"}]


class Person(BaseModel):
    name: str
    age: int


class Pet(BaseModel):
    kind: str
    legs: int
    owner: Person


def check(obj: Any, model: type[BaseModel]) -> None:
    assert isinstance(obj, model), obj
    model.model_validate(obj.model_dump())  # and it round-trips
    assert abs(obj.age if isinstance(obj, Person) else obj.legs) <= 2**53 - 1


@pytest.mark.parametrize("model", [Person, Pet])
def test_instructor_json_schema_mode_returns_valid_objects(server: Server, model: type[BaseModel]) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.JSON_SCHEMA)
    obj = client.chat.completions.create(model="stories", response_model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                         max_tokens=120, temperature=0, max_retries=0)
    check(obj, model)


@pytest.mark.parametrize("model", [Person, Pet])
def test_langchain_with_structured_output_json_schema_returns_valid_objects(server: Server, model: type[BaseModel]) -> None:
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="stories", temperature=0, max_tokens=120, max_retries=0)  # type: ignore[arg-type]
    obj = llm.with_structured_output(model, method="json_schema").invoke("Lily")
    check(obj, model)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose chat template writes Hermes-style ``<tool_call>`` (the parser is recognized from it)."""
    from test_tools import TEMPLATE  # core/tests_serve's tool template, on the path through conftest.py

    tmp = tmp_path_factory.mktemp("tools")
    (tmp / "tools.jinja").write_text(TEMPLATE, encoding="utf-8")
    s = Server(tmp, args=("--chat-template", str(tmp / "tools.jinja")))
    yield s
    s.stop()


@pytest.mark.parametrize("model", [Person, Pet])
def test_instructor_tools_mode_returns_valid_objects(agent: Server, model: type[BaseModel]) -> None:
    # TOOLS mode sends the model as a function tool with a named tool_choice: lmdock constrains the
    # call's arguments to its schema, so the object validates by construction (issue 30)
    client = instructor.from_openai(openai.OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    obj = client.chat.completions.create(model="stories", response_model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                         max_tokens=160, temperature=0, max_retries=0)
    check(obj, model)


def test_langchain_with_structured_output_function_calling_returns_a_valid_object(agent: Server) -> None:
    llm = ChatOpenAI(base_url=f"{agent.url}/v1", api_key="unused", model="stories", temperature=0, max_tokens=160, max_retries=0)  # type: ignore[arg-type]
    obj = llm.with_structured_output(Person, method="function_calling").invoke("Lily")
    check(obj, Person)
