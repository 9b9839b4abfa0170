"""What a new user trips on (issue 15): the CLI's -n, --stream/--json, chat, --version, batch, and the
errors for mistyped names.  Through the FAKE backend (core plumbing only); the real engines are in the
plugins' tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lmdock import LLM, SamplingParams
from lmdock._cli.main import main
from lmdock._config.schema import build
from lmdock._plugin.errors import ConfigError, RequestError

GEN = ["generate", "-m", "m", "--backend", "fake", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import lmdock

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"lmdock {lmdock.__version__}")


def test_generate_n_3_stream_shows_three_labelled_completions(fake: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*GEN, "-n", "3", "--json", "ab"]) == 0
    want = [c["text"] for c in json.loads(capsys.readouterr().out)[0]["outputs"]]
    assert len(want) == 3
    assert main([*GEN, "-n", "3", "--stream", "ab"]) == 0
    out = capsys.readouterr().out
    for i in range(3):
        assert f"[completion {i}] " in out
    # each completion's pieces, gathered under their labels, are the completion's text
    got: dict[int, str] = {}
    for part in out.rstrip("\n").split("[completion ")[1:]:
        index, text = part.split("] ", 1)
        got[int(index)] = got.get(int(index), "") + text.rstrip("\n")
    assert [got[i] for i in range(3)] == [w.rstrip("\n") for w in want]


def test_stream_json_is_json_lines_that_join_to_the_outputs(fake: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*GEN, "-n", "2", "--json", "ab", "cde"]) == 0
    outputs = json.loads(capsys.readouterr().out)
    assert main([*GEN, "-n", "2", "--stream", "--json", "ab", "cde"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    texts: dict[tuple[int, int], str] = {}
    finish: dict[tuple[int, int], str] = {}
    for rec in lines:
        key = (rec["prompt"], rec["index"])
        texts[key] = texts.get(key, "") + rec["text"]
        if rec["finish_reason"]:
            finish[key] = rec["finish_reason"]
    for p, out in enumerate(outputs):
        for c in out["outputs"]:
            assert texts[(p, c["index"])] == c["text"]
            assert finish[(p, c["index"])] == c["finish_reason"]


def test_several_prompts_with_n_are_labelled(fake: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*GEN, "-n", "2", "ab", "cde"]) == 0
    out = capsys.readouterr().out
    for p in range(2):
        for i in range(2):
            assert f"=== prompt {p}, completion {i} ===" in out


def test_stream_generate_refuses_n_above_1_instead_of_dropping(fake: object) -> None:
    with LLM("m", backend="fake") as llm:
        async def run() -> list[str]:
            return [d async for d in llm.stream_generate("ab", {"n": 2, "max_new_tokens": 3})]

        with pytest.raises(RequestError, match=r"n=2.*LLM.stream"):
            asyncio.run(run())
        last = list(llm.stream("ab", {"n": 2, "max_new_tokens": 3, "seed": 1}))[-1]
        assert [c.index for c in last.outputs] == [0, 1]


def test_chat_without_template_names_the_flag_before_loading(fake: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    assert main(["chat", "-m", str(folder), "--backend", "fake", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--chat-template FILE" in err and "chat_template=" not in err
    assert fake.engines == []  # type: ignore[attr-defined]  # refused before the model was loaded
    # a model whose files cannot tell: refused after loading, with the CLI's wording too
    assert main(["chat", "-m", "m", "--backend", "fake", "hi"]) == 2
    assert "--chat-template FILE" in capsys.readouterr().err


def test_chat_stream_and_json(fake: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    chat = ["chat", "-m", "m", "--backend", "fake", "--chat-template", str(template), "--max-new-tokens", "5", "--temperature", "0"]
    assert main([*chat, "--json", "ab"]) == 0
    text = json.loads(capsys.readouterr().out)["outputs"][0]["text"]
    assert main([*chat, "--stream", "ab"]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert main([*chat, "--stream", "--json", "ab"]) == 0
    assert "".join(json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()) == text
    assert main([*chat, "-n", "3", "--temperature", "1", "--seed", "2", "ab"]) == 0
    out = capsys.readouterr().out
    assert [f"=== completion {i} ===" in out for i in range(3)] == [True] * 3


def test_batch_progress_shows_tokens_per_second_and_eta(capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock._llm.progress import Progress  # lmdock batch's bar, shared with LLM.generate

    bar = Progress(4, enabled=True)
    bar.update(10)
    err = capsys.readouterr().err
    assert "1/4" in err and "tok/s" in err and "ETA " in err


def test_unknown_model_name_lists_the_config_models(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (isolated / "lmdock.toml").write_text(f'[models.stories]\nmodel = "{isolated}"\n[models.other]\nmodel = "{isolated}"\n')
    assert main(["generate", "-m", "storie", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no model named 'storie'" in err and "did you mean 'stories'?" in err and "stories, other" in err


def test_plugin_allow_list_naming_nothing_installed_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "LMDOCK_PLUGINS": "bogus"}
    env.pop("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-m", "lmdock", "backends"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0
    assert "LMDOCK_PLUGINS=bogus names 'bogus', which is not installed" in out.stderr
    assert "pip install lmdock-hf" not in out.stdout


def test_sampling_aliases_and_did_you_mean() -> None:
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(min_tokens=2, max_tokens=5).min_new_tokens == 2
    assert SamplingParams(best_of=3, use_beam_search=True).beam_width == 3
    with pytest.raises(TypeError, match="beam_width=N"):
        SamplingParams(best_of=3)
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(TypeError, match="another name for 'max_new_tokens'"):
        SamplingParams(max_tokens=5, max_new_tokens=6)
    assert build(SamplingParams, {"max_tokens": 7}).max_new_tokens == 7
    with pytest.raises(ConfigError, match="did you mean 'top_p'"):
        build(SamplingParams, {"topp": 0.5})


def test_config_unknown_key_did_you_mean(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (isolated / "lmdock.toml").write_text('[models.a]\nmodel = "x"\nbakend = "hf"\n')
    assert main(["config", "check"]) == 2
    assert "models.a.bakend: unknown key 'bakend'; did you mean 'backend'?" in capsys.readouterr().err


def test_import_lmdock_defers_asyncio_pluggy_and_toml() -> None:
    code = "import sys, lmdock; print([m for m in ('asyncio', 'pluggy', 'concurrent.futures', 'tomllib') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- lmdock batch --------------------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_runs_resumes_and_isolates_bad_lines(fake: object, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "x", "prompt": "ab", "max_tokens": 4, "temperature": 0}},
        {"custom_id": "b", "body": {"prompt": ["cde"], "max_tokens": 3, "n": 2, "seed": 1}},
    ]
    bad = [
        {"custom_id": "c", "body": {"prompt": "ab", "max_tokenz": 4}},
        {"custom_id": "d", "body": {"prompt": "ab", "temperature": -1}},
        {"custom_id": "e", "url": "/v1/moderations", "body": {"input": "ab"}},
        {"custom_id": "g", "method": "GET", "body": {"prompt": "ab"}},
        {"custom_id": "h", "url": "/v1/embeddings", "body": {"input": "ab", "max_tokens": 3}},
        {"custom_id": "i", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "ab"}], "top_logprobs": 2}},
        {"custom_id": "j", "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"},
                                                                            {"type": "image_url", "image_url": {"url": "x"}}]}]}},
        {"custom_id": "k", "body": {"prompt": ["ab", "cd"]}},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in [good[0], *bad, good[1]]))
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake"]) == 1
    out = {r["custom_id"]: r for r in _lines(dst)}
    assert len(_lines(dst)) == 10
    assert out["a"]["response"]["body"]["choices"][0]["finish_reason"] in ("length", "stop")  # type: ignore[index]
    assert out["a"]["response"]["body"]["choices"][0]["logprobs"] is None  # type: ignore[index]
    assert out["a"]["response"]["body"]["usage"]["completion_tokens"] <= 4  # type: ignore[index]
    assert len(out["b"]["response"]["body"]["choices"]) == 2  # type: ignore[index]
    errors = {k: r["error"]["message"] for k, r in out.items() if r["error"]}  # type: ignore[index]
    assert errors["c"].startswith("line 2: ") and "did you mean 'max_tokens'" in errors["c"]
    assert "temperature" in errors["d"]
    assert "/v1/moderations" in errors["e"] and "/v1/embeddings" in errors["e"]
    assert "method 'GET'" in errors["g"]
    assert "'max_tokens' is not supported for /v1/embeddings" in errors["h"]
    assert "top_logprobs needs logprobs: true" in errors["i"]
    assert "messages[0].content[1] is a 'image_url' part" in errors["j"]
    assert "prompt holds 2 prompts" in errors["k"]
    # with greedy sampling the same line gives the same text as generate
    with LLM("m", backend="fake") as llm:
        want = llm.generate("ab", {"max_new_tokens": 4, "temperature": 0})[0].outputs[0].text
    assert out["a"]["response"]["body"]["choices"][0]["text"] == want  # type: ignore[index]

    # resumable: everything with a custom_id in the output is skipped; a new line runs
    before = dst.read_text()
    src.write_text(src.read_text() + json.dumps({"custom_id": "f", "body": {"prompt": "cde", "max_tokens": 2}}) + "\n")
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake"]) == 0
    assert dst.read_text().startswith(before)
    assert [r["custom_id"] for r in _lines(dst)[10:]] == ["f"]
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake"]) == 0  # nothing left to run
    assert len(_lines(dst)) == 11


def test_batch_refuses_a_file_whose_lines_cannot_be_resumed(fake: object, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Every line needs a custom_id of its own (OpenAI's batch files require one, and a rerun skips the
    ids already done): a line without one was appended again on every rerun; now nothing runs."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": "a", "body": {"prompt": "ab"}}, {"body": {"prompt": "ab"}}, {"custom_id": "a", "body": {"prompt": "cd"}},
             {"custom_id": 7, "body": {"prompt": "ab"}}]
    src.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n{not json\n")
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake"]) == 2
    err = capsys.readouterr().err
    assert "line 2 has no custom_id" in err and "line 3 repeats custom_id 'a' of line 1" in err
    assert "line 4 has no custom_id" in err and "line 6 is not JSON" in err and "nothing was run" in err
    assert not dst.exists()


def test_batch_chat_lines_need_a_template_and_take_chat_template(fake: object, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    src, dst, template = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "t.jinja"
    line = {"custom_id": "q", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 3}}
    src.write_text(json.dumps(line) + "\n")
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "(line 1)" in err and "--chat-template FILE" in err
    assert dst.read_text() == ""  # nothing was run, so a rerun with the template runs the line
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake", "--chat-template", str(template)]) == 0
    (rec,) = _lines(dst)
    assert rec["response"]["body"]["object"] == "chat.completion"  # type: ignore[index]
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake", "--chat-template", str(tmp_path / "nope")]) == 2
    assert "cannot read the chat template" in capsys.readouterr().err
