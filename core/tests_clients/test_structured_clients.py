"""instructor's and LangChain's structured output against a real ``lmdock serve`` (stories260K on hf):
each returns a valid object of the Pydantic model it was given.

instructor's JSON_SCHEMA mode sends the model's JSON schema without ``strict`` and without
``additionalProperties``; LangChain sends ``strict: true`` and ``additionalProperties: false``. Both
leave ``age: int`` unbounded. lmdock closes the listed object and keeps the integer within
±(2**53 - 1) (docs/structured-output.md), so even this tiny model finishes the object within its
budget (without that, both end at the length limit: instructor's on keys and digits, LangChain's on
digits)."""

from __future__ import annotations

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
