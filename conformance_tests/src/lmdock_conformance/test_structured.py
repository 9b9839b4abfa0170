"""Structured output (capability ``structured_output``): JSON schemas, regexes, a choice list and a
grammar constrain what the model writes.  Every output that the grammar completed (finish_reason
"stop") parses and validates with ``jsonschema`` (an implementation independent of the grammar engine)
or full-matches its regex (Python's ``re``), greedy and sampled, batched and alone; seeded sampled
outputs are the same either way; a schema that cannot be compiled fails its request alone.

The schemas bound every string, array and number, so that even the 260K-parameter test model closes
its documents within the token budget; an output cut by the budget ends with finish_reason "length"
after exactly ``max_new_tokens`` tokens."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from lmdock import GrammarError, LmdockError, RequestError, SamplingParams

pytestmark = pytest.mark.requires("structured_output")

BUDGET = 160
PROMPTS = ["Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog", "Tim had a", "In the park"]

SHORT = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat-required": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                      "required": ["name", "age"], "additionalProperties": False},
    "nested-object": {"type": "object", "properties": {"hero": {"type": "object", "properties": {"name": SHORT, "friend": {
        "type": "object", "properties": {"name": SHORT}, "required": ["name"], "additionalProperties": False}},
        "required": ["name", "friend"], "additionalProperties": False}}, "required": ["hero"], "additionalProperties": False},
    "array-bounded": {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                      "minItems": 2, "maxItems": 4}}, "required": ["words"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry"]}, "animal": {"type": "string", "enum": ["cat", "dog"]}},
             "required": ["mood", "animal"], "additionalProperties": False},
    "integer-range": {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                      "count": {"type": "integer", "minimum": 10, "maximum": 999}}, "required": ["score", "count"], "additionalProperties": False},
    "number-range": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}, "t": {"type": "number", "exclusiveMinimum": -3, "maximum": 40}},
                     "required": ["p", "t"], "additionalProperties": False},
    "optional-keys": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "note": SHORT, "tag": {"enum": ["a", "b"]}},
                      "required": ["id"], "additionalProperties": False},
    "string-pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "word": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
                       "required": ["code", "word"], "additionalProperties": False},
    "array-of-objects": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"enum": ["x", "y", "z"]}, "v": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k", "v"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "booleans-and-null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}, "either": {"type": ["boolean", "null"]}},
                          "required": ["ok", "none", "either"], "additionalProperties": False},
    "top-level-array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 1, "maxItems": 5},
    "any-of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5}]}},
               "required": ["value"], "additionalProperties": False},
}
REGEXES = [r"[a-z]{3,8}( [a-z]{2,6}){1,3}\.", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)", r"[A-Z][a-z]{1,9}, age [1-9]\d?"]
CHOICES = ["yes", "no", "maybe", "once upon a time"]

MODES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9, top_p=0.95, seed=1234),
}


def _params(mode: str, so: Any, **extra: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=BUDGET, structured_output=so, **{**MODES[mode], **extra})


def _check_json(schema: dict, out: Any) -> bool:
    """Validate a completed document; an output cut by the budget must have used the whole budget."""
    import jsonschema

    if out.finish_reason == "length":
        assert len(out.token_ids) == BUDGET
        return False
    assert out.finish_reason == "stop", out.finish_reason
    jsonschema.validate(json.loads(out.text), schema)
    return True


@pytest.mark.parametrize("mode", list(MODES))
def test_json_schemas_validate_batched_and_alone(llm: Any, mode: str) -> None:
    names = list(SCHEMAS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    batched = llm.generate(prompts, [_params(mode, {"json": SCHEMAS[n]}) for n in names])
    alone = [llm.generate(p, _params(mode, {"json": SCHEMAS[n]}))[0] for p, n in zip(prompts, names)]
    complete = 0
    for name, b, a in zip(names, batched, alone):
        # greedy, and seeded sampling, give the same tokens batched or alone
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
        complete += _check_json(SCHEMAS[name], b.outputs[0])
    assert complete >= len(names) - 2, f"only {complete} of {len(names)} documents closed within {BUDGET} tokens"


@pytest.mark.parametrize("mode", list(MODES))
def test_regexes_full_match_batched_and_alone(llm: Any, mode: str) -> None:
    prompts = PROMPTS[: len(REGEXES)]
    batched = llm.generate(prompts, [_params(mode, {"regex": r}) for r in REGEXES])
    alone = [llm.generate(p, _params(mode, {"regex": r}))[0] for p, r in zip(prompts, REGEXES)]
    for regex, b, a in zip(REGEXES, batched, alone):
        out = b.outputs[0]
        assert out.token_ids == a.outputs[0].token_ids, regex
        assert out.finish_reason == "stop", (regex, out.text)
        assert re.fullmatch(regex, out.text), (regex, out.text)


@pytest.mark.parametrize("mode", list(MODES))
def test_choice_is_one_of_the_choices(llm: Any, mode: str) -> None:
    outs = llm.generate(PROMPTS, _params(mode, {"choice": CHOICES}))
    alone = [llm.generate(p, _params(mode, {"choice": CHOICES}))[0] for p in PROMPTS]
    for o, a in zip(outs, alone):
        assert o.outputs[0].text in CHOICES and o.outputs[0].finish_reason == "stop"
        assert o.outputs[0].token_ids == a.outputs[0].token_ids


def test_n_completions_each_follow_the_schema(llm: Any) -> None:
    schema = SCHEMAS["enum"]
    out = llm.generate("Once upon a time", SamplingParams(n=4, temperature=1.0, seed=7, max_new_tokens=BUDGET, structured_output={"json": schema}))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert _check_json(schema, c)
    assert len({c.text for c in out.outputs}) > 1, "four seeded completions were all the same"


def test_lark_grammar_and_json_object(llm: Any) -> None:
    grammar = 'start: "The " animal " is " color "."\nanimal: "cat" | "dog" | "bird"\ncolor: "red" | "blue"'
    out = llm.generate("Once upon a time", _params("sampled", {"grammar": grammar}))[0].outputs[0]
    assert re.fullmatch(r"The (cat|dog|bird) is (red|blue)\.", out.text) and out.finish_reason == "stop"
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=BUDGET, structured_output={"json": "object"}))[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.startswith("{") and len(out.token_ids) == BUDGET


#: GBNF (llama.cpp's grammar syntax) and, for the independent check, a Python regex of the same language
GBNF = [
    ('root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog" | "bird"\ncolor ::= "red" | "blue"',
     r"The (cat|dog|bird) is (red|blue)\."),
    ('root ::= word (" " word){1,2} "."\nword ::= [a-z]{2,5}', r"[a-z]{2,5}( [a-z]{2,5}){1,2}\."),
]


@pytest.mark.parametrize("mode", list(MODES))
def test_gbnf_grammars_full_match_their_language(llm: Any, mode: str) -> None:
    outs = llm.generate(PROMPTS[: len(GBNF)], [_params(mode, {"grammar": g}) for g, _ in GBNF])
    for (gbnf, regex), o in zip(GBNF, outs):
        out = o.outputs[0]
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), (gbnf, out.text)


def _chained_lark(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def _chained_defs(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"], "$defs": defs}


@pytest.mark.parametrize("so", [{"grammar": _chained_lark(5000)}, {"json": _chained_defs(5000)}], ids=["lark-5000-rules", "json-defs-5000-deep"])
def test_a_grammar_that_crashes_the_grammar_compiler_is_refused_and_the_process_lives_on(llm: Any, so: dict) -> None:
    """5,000 chained rules overflow llguidance's stack: lmdock compiles a request's grammar in a worker
    process first, so the worker dies, the request gets GrammarError, and this process serves on."""
    with pytest.raises(GrammarError, match="structured_output"):
        llm.generate("Once upon a time", _params("greedy", so))
    out = llm.generate("Once upon a time", _params("greedy", {"choice": CHOICES}))[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_a_regex_that_can_produce_no_token_is_refused_before_it_runs(llm: Any) -> None:
    params = _params("greedy", {"regex": r"[^\s\S]"})  # matches no character: not even a first token fits
    with pytest.raises(GrammarError, match="cannot produce a first token"):
        llm.check_grammar(params)  # the check alone, no engine step
    with pytest.raises(GrammarError, match="cannot produce a first token"):
        llm.generate_async("Once upon a time", params)  # refused at submit, before any step


def test_budget_reached_mid_document_is_length(llm: Any) -> None:
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=3, structured_output={"json": SCHEMAS["nested-object"]}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith('{"hero"'[: len(out.text)]) or out.text.startswith('{')


@pytest.mark.requires("logprobs")
def test_constrained_tokens_carry_all_the_probability(llm: Any) -> None:
    import math

    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=8, logprobs=5, structured_output={"choice": ["yes", "no"]}))[0].outputs[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    finite = [lp for lp in first.values() if math.isfinite(lp.logprob)]
    total = sum(math.exp(lp.logprob) for lp in finite)
    # only tokens that begin "yes" or "no" have probability, and they carry all of it
    assert total <= 1.0 + 1e-4
    for tid, lp in first.items():
        if math.isfinite(lp.logprob) and lp.logprob > -30:
            text = llm.tokenizer.decode([tid])
            assert "yes".startswith(text.strip()) or "no".startswith(text.strip()), text


@pytest.mark.requires("stream")
def test_streaming_ends_with_the_generated_document(llm: Any) -> None:
    params = _params("greedy", {"json": SCHEMAS["flat-required"]})
    snapshots = list(llm.stream("The cat", params))
    final = snapshots[-1]
    assert final.finished
    assert final.outputs[0].text == llm.generate("The cat", params)[0].outputs[0].text


def test_a_stop_cuts_a_constrained_output(llm: Any) -> None:
    params = _params("greedy", {"regex": REGEXES[0]})
    full = llm.generate("The cat", params)[0].outputs[0].text
    stop = full.split(" ")[1]
    out = llm.generate("The cat", params.replace(stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)] and out.stop_reason == stop


@pytest.mark.parametrize("bad", [
    {"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}},
    {"regex": "[a-z"},
    {"grammar": "start: undefined_rule"},
    {"json": "not json"},
], ids=["bad-pattern", "bad-regex", "bad-grammar", "json-text"])
def test_a_schema_that_does_not_compile_fails_alone(llm: Any, bad: dict) -> None:
    good = _params("sampled", {"json": SCHEMAS["enum"]})
    futures = [llm.generate_async(p, good) for p in PROMPTS[:3]]
    with pytest.raises(LmdockError) as info:
        llm.generate_async("One day", _params("sampled", bad)).result(timeout=120)
    assert isinstance(info.value, RequestError) and "structured_output" in str(info.value)
    alone = llm.generate(PROMPTS[0], good)[0].outputs[0].token_ids
    results = [f.result(timeout=300) for f in futures]
    assert results[0].outputs[0].token_ids == alone
    for r in results:
        _check_json(SCHEMAS["enum"], r.outputs[0])
