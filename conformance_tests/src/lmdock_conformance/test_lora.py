"""LoRA adapters (``LoRARequest``), for backends that declare ``lora``: an adapter changes the output,
requests under different adapters and the base model in one batch each equal the request run alone,
and an adapter that cannot load fails its request alone.  The adapters are written by
``lmdock_conformance._models.lora_adapter`` (random weights, a fixed seed) for the model under test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmdock import LoRARequest, RequestError, SamplingParams

from lmdock_conformance._models import lora_adapter

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = ["Once upon a time", "The little dog"]


@pytest.fixture(scope="module")
def loras(lmdock_setup: Any, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    if not (Path(lmdock_setup.model or "") / "config.json").is_file():
        pytest.skip("the LoRA checks write adapters for a transformers checkpoint folder")
    root = tmp_path_factory.mktemp("loras")
    return [LoRARequest(f"conf{i}", lora_adapter(lmdock_setup.model, root / f"conf{i}", seed=i)) for i in (1, 2)]


@pytest.fixture(scope="module")
def lora_llm(lmdock_setup: Any, llm: Any) -> Iterator[Any]:
    """An engine started with LoRA on: the session's where its options set ``build.max_loras``, else
    one of this module's own (vLLM turns LoRA on only as its engine starts, from max_loras)."""
    build = dict(lmdock_setup.options.get("build") or {})
    if build.get("max_loras"):
        yield llm
        return
    engine = lmdock_setup.llm(build={**build, "max_loras": 2})
    yield engine
    engine.shutdown()


def _run(out: Any) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


@pytest.mark.requires("lora")
def test_an_adapter_changes_the_output(lora_llm: Any, loras: list[LoRARequest], lmdock_setup: Any) -> None:
    base = _run(lora_llm.generate(PROMPTS[0], GREEDY)[0])
    for lora in loras:
        assert _run(lora_llm.generate(PROMPTS[0], GREEDY, lora_request=lora)[0])[0] != base[0]
    tokens, lps = _run(lora_llm.generate(PROMPTS[0], GREEDY)[0])  # the base model is unchanged after them
    assert tokens == base[0]
    assert lps == pytest.approx(base[1], abs=lmdock_setup.tolerance)


@pytest.mark.requires("lora")
def test_a_mixed_batch_equals_each_request_alone(lora_llm: Any, loras: list[LoRARequest], lmdock_setup: Any) -> None:
    plan = [(p, lora) for p in PROMPTS for lora in (None, *loras)]
    alone = [_run(lora_llm.generate(p, GREEDY, lora_request=lora)[0]) for p, lora in plan]
    together = [_run(o) for o in lora_llm.generate([p for p, _ in plan], GREEDY, lora_request=[lora for _, lora in plan])]
    for (tokens, lps), (want_tokens, want_lps) in zip(together, alone):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=lmdock_setup.tolerance)


@pytest.mark.requires("lora")
def test_an_adapter_that_cannot_load_fails_its_request_alone(lora_llm: Any, loras: list[LoRARequest], tmp_path: Path) -> None:
    want = _run(lora_llm.generate(PROMPTS[0], GREEDY, lora_request=loras[0])[0])
    good = lora_llm.generate_async(PROMPTS[0], GREEDY, lora_request=loras[0])
    with pytest.raises(RequestError, match="missing"):
        lora_llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("missing", tmp_path / "none"))
    assert _run(good.result(timeout=120))[0] == want[0]
