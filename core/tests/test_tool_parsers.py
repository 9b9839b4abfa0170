"""Tool-call and reasoning parsers (``lmdock.tools``) on outputs in the formats real model families
write (Qwen 2.5/3 and Hermes 3, Llama 3.1/3.2, Mistral 7B v0.3, Llama 4's pythonic), read whole and
streamed at random chunk boundaries: both reads must give the same calls."""

from __future__ import annotations

import json
import random

import pytest
from lmdock import ConfigError, RequestError, tools
from lmdock.tools import ChatPlan, ReasoningStream, get_parser, get_reasoning_parser

WEATHER = '{"city": "San Francisco", "metric": "celsius"}'

# (parser, model output, expected content, expected [(name, arguments)])
RECORDED = [
    # Qwen2.5-7B-Instruct: one call, nothing around it
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    # Hermes-3: text before two calls
    ("hermes", 'Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>',
     "Let me check both cities.", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')]),
    # text after the calls stays content too (Qwen 2.5 under auto, unconstrained)
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nI will wait for <the> result.',
     "Checking.\n\nI will wait for <the> result.", [("get_time", "{}")]),
    # empty arguments (vLLM #32436 crashed on these), and arguments left out entirely
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None, [("get_time", "{}")]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", "{}")]),
    # nested objects and escapes inside the arguments
    ("hermes", '<tool_call>\n{"name": "run", "arguments": {"code": "print(\\"}\\")", "opts": {"a": [1, {"b": null}]}}}\n</tool_call>',
     None, [("run", '{"code": "print(\\"}\\")", "opts": {"a": [1, {"b": null}]}}')]),
    # Llama 3.1 JSON, with and without <|python_tag|>, several calls separated by ";"
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("llama3_json", "The weather is sunny.", "The weather is sunny.", []),
    # Mistral 7B Instruct v0.3
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Sure.", [("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] Then I [will] answer.', "Then I [will] answer.", [("get_time", "{}")]),
    # Llama 3.2 / 4 pythonic
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius"), get_time()]', None,
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ("pythonic", "[toggle(on=True, level=None, tags=['a', 'b'])]", None, [("toggle", '{"on": true, "level": null, "tags": ["a", "b"]}')]),
    ("pythonic", "It is sunny in [Paris] today.", "It is sunny in [Paris] today.", []),
]

# malformed calls from an unconstrained model under tool_choice "auto": the text stays content
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    ("hermes", "<tool_call>\nget_weather(city=Paris)\n</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": Paris}}'),
    ("mistral", "[TOOL_CALLS] get_weather"),
    ("pythonic", "[get_weather(city=Paris"),
]


def _chunks(text: str, rng: random.Random) -> list[str]:
    """``text``'s prefixes at random boundaries (chunks of 1 to 8 characters), the whole text last."""
    cuts, i = [], 0
    while i < len(text):
        i = min(len(text), i + rng.randint(1, 8))
        cuts.append(text[:i])
    return cuts


def _streamed(parser: tools.ToolParser, text: str, seed: int) -> tuple[str, list[list[str]], tools.ToolStream]:
    stream, content, calls = parser.stream(), "", []
    prefixes = _chunks(text, random.Random(seed))
    for n, prefix in enumerate(prefixes):
        new, deltas = stream.feed(prefix, final=n == len(prefixes) - 1)
        content += new
        for d in deltas:
            if d.id is not None:  # a call is announced once, id and name first
                assert d.index == len(calls) and d.id.startswith("call_") and d.name
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    return content, calls, stream


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_whole_parse(name: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parsed = get_parser(name).parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for c in parsed.calls:
        assert isinstance(json.loads(c.arguments), dict) and c.id.startswith("call_")
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_streamed_parse_agrees_at_any_chunking(name: str, text: str, content: str | None, calls: list[tuple[str, str]], seed: int) -> None:
    streamed_content, streamed, stream = _streamed(get_parser(name), text, seed)
    assert [tuple(c) for c in streamed] == calls
    assert streamed_content.strip() == (content or "")
    assert [(c.name, c.arguments, c.id) for c in stream.calls(text)] == [(n, a, i) for (n, a), i in zip(calls, stream.ids)]


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_stay_content(name: str, text: str) -> None:
    parsed = get_parser(name).parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_text_that_may_open_a_call_waits() -> None:
    stream = get_parser("hermes").stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("Hello <tool>") == ("<tool>", [])  # it was not a call after all


def test_a_call_cut_by_max_tokens_is_dropped_and_the_closed_ones_kept() -> None:
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "argu'
    parsed = get_parser("hermes").parse(text)
    assert [c.name for c in parsed.calls] == ["a"]


def test_unknown_parser_names_the_closest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'hermes'"):
        get_parser("hermez")
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        get_reasoning_parser("thnk")


def test_template_recognition() -> None:
    assert tools.parser_for_template("... <tool_call>\n{{ tool_call | tojson }}\n</tool_call> ...").name == "hermes"  # type: ignore[union-attr]
    assert tools.parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"  # type: ignore[union-attr]
    assert tools.parser_for_template("{{ bos_token }}{{ m.content }}") is None


# -- reasoning --------------------------------------------------------------------------------------

THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), [
    (THOUGHT, False, "\nThe user wants the weather.\n", "It is sunny."),
    ("The user wants the weather.\n</think>\n\nIt is sunny.", True, "The user wants the weather.\n", "It is sunny."),
    ("It is sunny.", False, None, "It is sunny."),
    ("still thinking", True, "still thinking", ""),
])
def test_reasoning_split(text: str, opened: bool, reasoning: str | None, content: str) -> None:
    split = get_reasoning_parser("think").split(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)
    for seed in range(5):
        stream, got = ReasoningStream(get_reasoning_parser("think"), opened), ["", ""]
        prefixes = _chunks(text, random.Random(seed))
        for n, prefix in enumerate(prefixes):
            r, c = stream.feed(prefix, final=n == len(prefixes) - 1)
            got[0] += r
            got[1] += c
        assert got == [reasoning or "", content]


def test_a_close_without_an_open_is_thinking_when_read_whole() -> None:
    # a template that opened <think> in a way opened_by() missed (DeepSeek-R1): the whole read still
    # splits; a stream cannot take back what it sent as content, which is why the prompt is read first
    split = get_reasoning_parser("think").split("The user wants the weather.\n</think>It is sunny.", False)
    assert (split.reasoning, split.content) == ("The user wants the weather.\n", "It is sunny.")


def test_prompt_that_opens_thinking() -> None:
    think = get_reasoning_parser("think")
    assert think.opened_by("<|im_start|>assistant\n<think>\n")
    assert not think.opened_by("<think>\nx\n</think>\n<|im_start|>assistant\n")


# -- a request's plan -------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _plan(**kw: object) -> ChatPlan:
    args: dict = {"tools": TOOLS, "tool_choice": None, "parallel": None, "template_kwargs": None, "model": "m",
                  "tool_parser": "hermes", "reasoning_parser": None, "template": None}
    args.update(kw)
    return ChatPlan.make(args.pop("tools"), args.pop("tool_choice"), args.pop("parallel"), args.pop("template_kwargs"), **args)


def test_plan_reads_thinking_then_calls() -> None:
    plan = _plan(reasoning_parser="think")
    plan.after_render("<think>\n")
    reading = plan.read('I should call it.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert reading.reasoning == "I should call it." and reading.content is None
    assert [(c.name, c.arguments) for c in reading.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_thinking_off_reads_no_thinking() -> None:
    plan = _plan(reasoning_parser="think", template_kwargs={"enable_thinking": False})
    assert plan.read("<think>x</think>y").reasoning is None


def test_plan_constraints() -> None:
    yes, no = (True, ""), (False, "no grammar engine")
    assert _plan(tool_choice="required").constraint(yes, None, "hf")["grammar"].startswith('start: "<tool_call>"')  # type: ignore[index]
    assert "PLAIN" in _plan(tool_choice="auto").constraint(yes, None, "hf")["grammar"]  # type: ignore[index]
    assert _plan(tool_choice="auto").constraint(no, None, "x") is None  # read only
    assert _plan(tool_choice="none").constraint(yes, None, "hf") is None
    with pytest.raises(RequestError, match="cannot constrain"):
        _plan(tool_choice="required").constraint(no, None, "x")
    with pytest.raises(RequestError, match="response_format"):
        _plan(tool_choice="required").constraint(yes, {"json": {}}, "hf")
    with pytest.raises(RequestError, match="no tool_parser"):
        _plan(tool_parser=None)
    with pytest.raises(RequestError, match="not in tools"):
        _plan(tool_choice={"type": "function", "function": {"name": "fly"}})
    with pytest.raises(RequestError, match=r"tools\[0\]"):
        _plan(tools=[{"type": "function", "function": {"name": "x", "parameters": "no"}}])


STRICT = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                                       "required": ["a"], "additionalProperties": False}}}]
# (parser, a call in its format as the grammar writes it (compact JSON), a call to a function not in tools)
CALLS = {
    "hermes": ('<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>', '<tool_call>\n{"name":"g"'),
    "mistral": ('[TOOL_CALLS][{"name":"f","arguments":{"a":1}}]', '[TOOL_CALLS][{"name":"g"'),
    "llama3_json": ('{"name":"f","parameters":{"a":1}}', '{"name":"g"'),
    "pythonic": ("[f(a=1)]", "[g("),
}


def _matcher(grammar: str) -> tuple[object, object]:
    """An llguidance matcher for ``grammar`` over stories260K's tokenizer (read as JSON text)."""
    import os
    from pathlib import Path

    llg = pytest.importorskip("llguidance")
    folder = Path(os.environ.get("LMDOCK_MODELS", "")) / "stories260K"
    if not (folder / "tokenizer.json").is_file():
        pytest.fail(f"stories260K not found under LMDOCK_MODELS ({folder})")
    tok = llg.LLTokenizer((folder / "tokenizer.json").read_text(), n_vocab=512, eos_token=2)
    compiled = llg.LLMatcher.grammar_from_lark(grammar)
    assert llg.LLMatcher.validate_grammar(compiled) == ""
    return llg.LLMatcher(tok, compiled), tok


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar lets a model write ``text`` whole and stop there."""
    matcher, tok = _matcher(grammar)
    ok = all(matcher.consume_token(t) for t in tok.tokenize_str(text))  # type: ignore[attr-defined]
    return ok and matcher.is_accepting()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_forced_grammar_takes_valid_calls_only(name: str) -> None:
    good, bad = CALLS[name]
    grammar = get_parser(name).grammar(STRICT, parallel=False, lazy=False)
    assert grammar is not None
    assert _accepts(grammar, good)
    assert get_parser(name).parse(good).calls[0].name == "f"  # what the grammar writes, the parser reads
    assert not _accepts(grammar, bad) and not _accepts(grammar, "Hello")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_lazy_grammar_takes_text_or_text_then_valid_calls(name: str) -> None:
    good, bad = CALLS[name]
    grammar = get_parser(name).grammar(STRICT, parallel=True, lazy=True)
    assert grammar is not None
    assert _accepts(grammar, "Once upon a time, a <big> [red] ball.")
    assert _accepts(grammar, good)
    assert not _accepts(grammar, bad)
    if get_parser(name).marker and name != "llama3_json":  # formats that allow text before the calls
        assert _accepts(grammar, "Let me <see>. " + good)
        assert not _accepts(grammar, "Let me see. " + bad)


# pydantic's nested models (instructor's and LangChain's tools): a $ref into the parameters' own $defs
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
NESTED = [{"type": "function", "function": {"name": n, "parameters": {
    "$defs": {"Person": PERSON}, "type": "object", "properties": {"owner": {"$ref": "#/$defs/Person"}}, "required": ["owner"]}}}
    for n in ("f", "g")]
NESTED_CALLS = {
    "hermes": '<tool_call>\n{"name":"g","arguments":{"owner":{"name":"Lily","age":3}}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name":"g","arguments":{"owner":{"name":"Lily","age":3}}}]',
    "llama3_json": '{"name":"g","parameters":{"owner":{"name":"Lily","age":3}}}',
    "pythonic": '[g(owner={"name":"Lily","age":3})]',
}


@pytest.mark.parametrize("name", sorted(NESTED_CALLS))
def test_forced_grammar_resolves_the_parameters_defs_and_bounds_what_they_leave_open(name: str) -> None:
    # the parameters' $defs are lifted to the embedding schema's root (a $ref resolves from the root),
    # one set per tool; the listed object is closed and the integer bounded, as for response_format
    grammar = get_parser(name).grammar(NESTED, parallel=False, lazy=False)
    assert grammar is not None
    good = NESTED_CALLS[name]
    assert _accepts(grammar, good)
    assert not _accepts(grammar, good.replace('"age":3', '"age":3,"x":1'))
    assert not _accepts(grammar, good.replace('"age":3', f'"age":{2**60}'))


@pytest.mark.parametrize("opened", [True, False])
def test_forced_grammar_lets_the_model_think_first(opened: bool) -> None:
    plan = _plan(tools=STRICT, tool_choice="required", parallel=False, reasoning_parser="think")
    plan.after_render("<think>\n" if opened else "")
    grammar = plan.constraint((True, ""), None, "hf")["grammar"]  # type: ignore[index]
    call = CALLS["hermes"][0]
    thought = "Hmm, <maybe> f.</think>\n\n" if opened else "<think>Hmm, <maybe> f.</think>\n\n"
    assert _accepts(grammar, thought + call)
    assert not _accepts(grammar, thought + "Hello")
    assert _accepts(grammar, call) != opened  # with the span open, the model must close it first


def test_the_guides_plugin_example_registers_a_parser() -> None:
    """docs/tools.md's plugin example, run: its parser is found by name and reads its format."""
    import re
    import types
    from pathlib import Path

    from lmdock._plugin.manager import get_registry
    from lmdock.tools import _registry

    text = (Path(__file__).resolve().parents[2] / "docs" / "tools.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "lmdock_register_parsers" in b)
    plugin = types.ModuleType("arrows_plugin")
    exec(block, plugin.__dict__)  # noqa: S102 - our own documentation
    registry = get_registry()
    registry.add_plugin(plugin, "arrows-plugin")
    _registry.reset()
    try:
        parsed = get_parser("arrows").parse('Sure >>>get_time\n{"tz": "UTC"}')
        assert parsed.content == "Sure" and [(c.name, c.arguments) for c in parsed.calls] == [("get_time", '{"tz": "UTC"}')]
        assert get_parser("arrows").parse(">>>get_time\n{nope").calls == []
        assert "arrows" in tools.parser_names()
    finally:
        registry.pm.unregister(plugin)
        _registry.reset()


def test_auto_grammar_leaves_thinking_and_text_free() -> None:
    plan = _plan(tools=STRICT, tool_choice="auto", reasoning_parser="think")
    plan.after_render("<think>\n")
    grammar = plan.constraint((True, ""), None, "hf")["grammar"]  # type: ignore[index]
    assert _accepts(grammar, "Hmm.</think>\nIt is sunny.")
    assert _accepts(grammar, "Hmm.</think>\n" + CALLS["hermes"][0])
    assert not _accepts(grammar, "Hmm.</think>\n" + CALLS["hermes"][1])
