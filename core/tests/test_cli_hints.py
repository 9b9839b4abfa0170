"""The CLI says what to type instead (issue 29): did-you-mean on flags, other tools' flags named with
lmdock's equivalent, ``--max-tokens`` taken as OpenAI's name; a GGUF file goes to a backend that reads
GGUF, or the error says which plugin to install.  FAKE backends (core plumbing only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeStepEngine
from lmdock import LLM, BackendError
from lmdock._cli.main import main
from lmdock._plugin import manager as _plugins
from lmdock.backend import Backend, BackendSpec


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "--max-tokns", "4", "x"], "--max-tokns: did you mean --max-tokens?"),
        (["generate", "--temprature", "1", "x"], "--temprature: did you mean --temperature?"),
        (["chat", "--sytem", "s", "x"], "--sytem: did you mean --system?"),
        (["serve", "--chat-tmplate", "f"], "--chat-tmplate: did you mean --chat-template?"),
        (["generate", "--max-model-len", "9", "x"], "--max-model-len: lmdock's is [models.NAME.build] max_seq_len in the config file"),
        (["generate", "--gpu-memory-utilization", "0.9", "x"], "lmdock's is [models.NAME.kv_cache] memory_fraction"),
        (["generate", "--served-model-name", "x", "y"], "--served-model-name: lmdock's is the model's name in the config file"),
        (["embed", "--temp", "0.5", "x"], "--temp: lmdock's is --temperature"),
        (["serve", "--tool-call-parser", "hermes"], "--tool-call-parser: lmdock's is tool_parser = \"hermes\" under [models.NAME]"),
    ],
)
def test_an_unknown_flag_names_the_right_one(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(argv, capsys)
    assert line.startswith("lmdock: error: unrecognized arguments") and says in line, line


def test_a_flag_nothing_resembles_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(["generate", "--zzzz", "x"], capsys) == "lmdock: error: unrecognized arguments: --zzzz"


def test_max_tokens_is_max_new_tokens(fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "-m", "m", "--backend", "fake", "--temperature", "0", "--json", "ab"]
    assert main([*argv, "--max-tokens", "3"]) == 0
    short = json.loads(capsys.readouterr().out)[0]["outputs"][0]["token_ids"]
    assert main([*argv, "--max-new-tokens", "3"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["outputs"][0]["token_ids"] == short and len(short) == 3


def _register(name: str, formats: set[str], priority: int, loaded: list[str]) -> None:
    def load(mc: Any, *_: Any) -> Any:
        loaded.append(name)
        return FakeStepEngine()

    spec = BackendSpec(name=name, kind="step", plugin_api="1.0", supports=frozenset({"generate"}),
                       model_formats=frozenset(formats), priority=priority, description="FAKE test backend")
    _plugins.get_registry().add_plugin(Backend(spec, load=load), name)


def test_auto_picks_a_backend_that_reads_the_models_format(isolated: Path) -> None:
    loaded: list[str] = []
    _register("tensors", {"hf"}, priority=50, loaded=loaded)
    _register("ggufer", {"gguf"}, priority=1, loaded=loaded)
    LLM("weights/model.Q8_0.gguf", backend="auto").shutdown()
    LLM("org/some-model", backend="auto").shutdown()
    assert loaded == ["ggufer", "tensors"]


def test_a_gguf_file_without_a_gguf_backend_says_what_to_install(isolated: Path) -> None:
    _register("tensors", {"hf"}, priority=50, loaded=[])
    with pytest.raises(BackendError, match=r"is a GGUF file; no installed backend can load that: pip install lmdock-llamacpp"):
        LLM("model.gguf", backend="auto")
    with pytest.raises(BackendError, match=r"backend 'tensors' does not load that: pip install lmdock-llamacpp"):
        LLM("model.gguf", backend="tensors")


def test_a_backend_named_for_the_wrong_format_points_at_the_one_that_reads_it(isolated: Path) -> None:
    loaded: list[str] = []
    _register("tensors", {"hf"}, priority=50, loaded=loaded)
    _register("ggufer", {"gguf"}, priority=1, loaded=loaded)
    with pytest.raises(BackendError, match=r"backend 'tensors' does not load that: use backend = 'ggufer'"):
        LLM("model.gguf", backend="tensors")
    with pytest.raises(BackendError, match=r"is a transformers checkpoint.*backend 'ggufer' does not load that: use backend = 'tensors'"):
        LLM("org/model", backend="ggufer")
    assert loaded == []


def test_a_call_dict_takes_openais_names_over_the_defaults(fake: Any) -> None:
    """``generate(p, {"max_tokens": 3})`` as a vLLM or OpenAI user writes it (the defaults always set
    max_new_tokens, which used to clash with the alias)."""
    from lmdock import ConfigError

    with LLM("m", backend="fake") as llm:
        out = llm.generate([[1, 5]], {"max_tokens": 3, "temperature": 0, "ignore_eos": True})[0].outputs[0]
        assert len(out.token_ids) == 3
        assert llm.sampling_params({"max_tokens": 7}).max_new_tokens == 7
        with pytest.raises(ConfigError, match="'max_tokens' is another name for 'max_new_tokens'"):
            llm.sampling_params({"max_tokens": 7, "max_new_tokens": 8})


def test_every_field_of_the_request_table_has_a_flag_under_each_of_its_names() -> None:
    """The sampling flags come from ``OPENAI_FIELDS``, the table the server and ``lmdock batch`` read."""
    from lmdock._cli.main import build_parser
    from lmdock._config.foreign import OPENAI_FIELDS

    flags = set(build_parser().commands["generate"].flags) & set(build_parser().commands["chat"].flags)
    for name, field in OPENAI_FIELDS.items():
        assert {"--" + name.replace("_", "-"), "--" + field.replace("_", "-")} <= flags, name


def test_logit_bias_allowed_token_ids_and_bad_words_flags_reach_sampling_params() -> None:
    from lmdock._cli.main import build_parser
    from lmdock._cli.sampling import sampling_overrides

    args = build_parser().parse_args(["generate", "--logit-bias", "432=-100", "--logit-bias", "7=2.5", "--allowed-token-ids", "1,2",
                                 "--allowed-token-ids", "3", "--bad-words", "cat", "--bad-words", "dog", "--max-completion-tokens", "5",
                                 "--min-tokens", "1", "--stop-token-ids", "9", "--no-skip-special-tokens", "x"])
    got = sampling_overrides(args)
    assert got == {"logit_bias": {432: -100.0, 7: 2.5}, "allowed_token_ids": [1, 2, 3], "bad_words": ["cat", "dog"],
                   "max_new_tokens": 5, "min_new_tokens": 1, "stop_token_ids": [9], "skip_special_tokens": False}
    from lmdock import SamplingParams

    assert SamplingParams(**got).logit_bias == {432: -100.0, 7: 2.5}


@pytest.mark.parametrize(("argv", "says"), [
    (["--logit-bias", "432"], "a logit bias is TOKEN_ID=BIAS"),
    (["--logit-bias", "x=1"], "a logit bias is TOKEN_ID=BIAS"),
    (["--allowed-token-ids", "1,a"], "token ids are integers separated by commas"),
])
def test_a_malformed_token_flag_says_its_form(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert says in _error(["generate", *argv, "x"], capsys)


def test_a_flag_the_backend_cannot_honour_is_refused_naming_it(fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-m", "m", "--backend", "fake", "--bad-words", "a", "ab"]) == 2
    assert "bad_words: backend 'fake' cannot bias or ban tokens" in capsys.readouterr().err
