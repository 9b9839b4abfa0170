"""The CLI flags docs/cli.md names, each exercised (docs/tests/audit.md points here): the sampling
flags reach their SamplingParams field through ``lmdock generate`` (a FAKE step engine records the
params: core plumbing only), the flags of other tools are refused with lmdock's equivalent, and
``lmdock batch --no-progress`` draws no bar on a terminal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from lmdock._cli.main import main
from lmdock._config.foreign import FOREIGN_FLAGS


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--top-k", "5"], "top_k", 5),
    (["--top-p", "0.5"], "top_p", 0.5),
    (["--min-p", "0.1"], "min_p", 0.1),
    (["--presence-penalty", "0.5"], "presence_penalty", 0.5),
    (["--frequency-penalty", "0.25"], "frequency_penalty", 0.25),
    (["--repetition-penalty", "1.1"], "repetition_penalty", 1.1),
    (["--min-new-tokens", "2"], "min_new_tokens", 2),
    (["--min-tokens", "2"], "min_new_tokens", 2),
    (["--ignore-eos"], "ignore_eos", True),
    (["--include-stop-str-in-output", "--stop", "zz"], "include_stop_str_in_output", True),
])
def test_each_documented_sampling_flag_reaches_its_field(fake: Any, capsys: pytest.CaptureFixture[str], argv: list[str],
                                                          field: str, value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdock._llm import facade

    seen: list[Any] = []
    monkeypatch.setattr(facade, "engine_request", _recording(facade.engine_request, seen))
    assert main(["generate", "-m", "m", "--backend", "fake", "--json", "--max-tokens", "3", *argv, "ab"]) == 0
    json.loads(capsys.readouterr().out)
    assert seen and getattr(seen[-1], field) == value


def _recording(request: Any, seen: list[Any]) -> Any:
    def wrapped(llm: Any, prompt: Any, params: Any, *a: Any, **kw: Any) -> Any:
        seen.append(params)
        return request(llm, prompt, params, *a, **kw)
    return wrapped


@pytest.mark.parametrize("flag", ["--ctx-size", "--tensor-parallel-size", "--pipeline-parallel-size", "--max-num-seqs",
                                  "--max-num-batched-tokens", "--enable-prefix-caching", "--quantization",
                                  "--trust-remote-code", "--n-predict", "--dtype"])
def test_each_foreign_flag_in_the_docs_names_lmdocks_equivalent(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", flag, "4", "x"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag}: lmdock's is {FOREIGN_FLAGS[flag]}" in line, line


def test_batch_no_progress_draws_no_bar_on_a_terminal(fake: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "ab", "max_tokens": 2}}) + "\n")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake"]) == 0
    assert "Requests" in capsys.readouterr().err  # the bar, on a terminal
    dst.unlink()
    assert main(["batch", str(src), str(dst), "-m", "m", "--backend", "fake", "--no-progress"]) == 0
    assert "Requests" not in capsys.readouterr().err and dst.read_text().count("\n") == 1


def test_serves_vllm_flags_map_onto_the_models_sections() -> None:
    """``lmdock serve``'s vLLM flags (docs/server.md) become the model's build and kv_cache settings,
    which each backend then honours or refuses as it does in the config file (the hf refusal of
    ``--tensor-parallel-size`` is in core/tests_serve/test_documented.py)."""
    from lmdock._cli.main import build_parser
    from lmdock._cli.serve import vllm_options

    args = build_parser().parse_args(["serve", "m", "--max-model-len", "128", "--dtype", "float32", "-tp", "2",
                                 "--gpu-memory-utilization", "0.5"])
    assert vllm_options(args) == {"build": {"max_seq_len": 128, "dtype": "float32", "tensor_parallel_size": 2},
                                   "kv_cache": {"memory_fraction": 0.5}}
    args = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "4"])
    assert vllm_options(args) == {"build": {"tensor_parallel_size": 4}}


def test_chat_system_goes_first_in_the_rendered_prompt(fake: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``lmdock chat --system S`` puts a system message before the user's: the prompt the engine got
    (``--json``'s ``prompt``, the rendered messages in order) shows it."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    chat = ["chat", "-m", "m", "--backend", "fake", "--chat-template", str(template), "--max-new-tokens", "2", "--json"]
    assert main([*chat, "--system", "be brief", "ab"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "be briefab"
    assert main([*chat, "ab"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "ab"
