"""lmdock-onnx on tiny random-weight checkpoints of other families, against transformers' own greedy
``generate`` (float32, eager): a sliding window (Mistral), mixtures of experts (Mixtral, Qwen3-MoE),
window layers with attention sinks and experts (gpt-oss), and a hybrid with state-space layers
(Bamba), which is refused."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from lmdock import LLM, BackendError, SamplingParams, UnsupportedError

sys.path.insert(0, str(Path(__file__).parent))
import _tiny  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NEW = 24  # with the 38-token prompt, well past the 16-token window


@pytest.fixture(scope="module")
def story() -> list[int]:
    from tokenizers import Tokenizer

    root = os.environ.get("LMDOCK_MODELS")
    if not root or not (Path(root) / "stories260K" / "tokenizer.json").is_file():
        pytest.fail("set LMDOCK_MODELS to the folder that holds stories260K (its tokenizer is the families')")
    return [1, *Tokenizer.from_file(str(Path(root) / "stories260K" / "tokenizer.json")).encode(_tiny.STORY, add_special_tokens=False).ids]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory, story: list[int]) -> Any:
    """family name -> (checkpoint folder, {prompt: transformers' tokens}); built once per family."""
    built: dict[str, tuple[Path, dict[tuple[int, ...], list[int]]]] = {}
    root = tmp_path_factory.mktemp("families")

    def get(name: str) -> tuple[Path, dict[tuple[int, ...], list[int]]]:
        if name not in built:
            model = _tiny.build(name, root / name, Path(os.environ["LMDOCK_MODELS"]) / "stories260K")
            built[name] = (root / name, {tuple(p): _tiny.greedy(model, p, NEW) for p in _prompts(story)})
        return built[name]

    return get


def _prompts(story: list[int]) -> list[list[int]]:
    """One long prompt, then a mixed-length batch (5 to 31 tokens: both sides of the window)."""
    return [story[:38], *(story[:n] for n in (5, 13, 22, 31))]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMDOCK_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "lmdock-cache"))


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(("name", "prefix_caching"), [("mistral", True), ("mistral", False), ("mixtral", True), ("qwen3_moe", True),
                                                    ("gpt_oss", True)])
def test_family_matches_transformers(family: Any, story: list[int], name: str, prefix_caching: bool) -> None:
    folder, reference = family(name)
    prompts = _prompts(story)
    with LLM(str(folder), backend="onnx", kv_cache={"enable_prefix_caching": prefix_caching}) as llm:
        assert _generate(llm, prompts[:1]) == [reference[tuple(prompts[0])]]  # one prompt
        assert _generate(llm, prompts[1:]) == [reference[tuple(p)] for p in prompts[1:]]  # a mixed batch in one call
        again = [prompts[3], prompts[0]]  # after the others, in the same LLM: no state left behind
        assert _generate(llm, again) == [reference[tuple(p)] for p in again]


def test_a_window_is_counted_in_tokens_not_buffer_positions(family: Any, story: list[int]) -> None:
    """The step passes a contiguous past to a windowed model (a gap in it would widen the window)."""
    folder, _ = family("mistral")
    with LLM(str(folder), backend="onnx") as llm:
        assert llm.engine.engine.contiguous_past
    folder, _ = family("mixtral")
    with LLM(str(folder), backend="onnx") as llm:
        assert not llm.engine.engine.contiguous_past  # no window: the zero-copy past over the whole capacity


@pytest.mark.parametrize(("config", "window"), [
    ({"sliding_window": 4096}, True),  # Mistral, Phi-3
    ({"sliding_window": None}, False),
    ({"sliding_window": 16, "use_sliding_window": False, "layer_types": ["full_attention"] * 2}, False),  # Qwen2 without
    ({"sliding_window": 16, "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"]}, True),
    ({"text_config": {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}}, True),  # Gemma 3
])
def test_which_configs_take_the_contiguous_past(config: dict[str, Any], window: bool) -> None:
    from lmdock_onnx._load import has_window

    assert has_window(config) is window


def test_a_recurrent_hybrid_is_refused(family: Any) -> None:
    folder, _ = family("bamba")
    with pytest.raises(UnsupportedError, match=r"(?s)bamba.*recurrent"):
        LLM(str(folder), backend="onnx")


def test_an_export_failure_is_one_line_and_a_log(family: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the exportable experts, Mixtral's export fails on aten::histc: torch's output (the
    traced graph) goes to a log file, and the error is one line naming it."""
    from lmdock_onnx import _export

    monkeypatch.setattr(_export, "exportable_experts", lambda lm: None)
    folder, _ = family("mixtral")
    capfd.readouterr()
    with pytest.raises(BackendError) as caught:
        LLM(str(folder), backend="onnx", backends={"onnx": {"cache_dir": str(tmp_path)}})
    message = str(caught.value)
    assert "\n" not in message and "histc" in message
    log = Path(message.rsplit("the full log: ", 1)[1].rstrip(")"))
    assert log.parent == tmp_path and "graph" in log.read_text() and "Traceback" in log.read_text()
    err = capfd.readouterr().err
    assert "graph(" not in err and "exporting" in err  # progress still reaches the terminal
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no partial export left
