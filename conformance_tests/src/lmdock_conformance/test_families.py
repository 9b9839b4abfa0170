"""Every model family of the zoo runs exactly as transformers' greedy generate runs it, or is refused
at load with the reason; a silent divergence is the one outcome that fails.

Run with ``--lmdock-zoo=DIR`` (built by ``python -m lmdock_conformance.zoo build DIR``); each family
loads once (its tests share the engine), except the test that switches prefix caching off: it runs
last and shuts the shared engine down before it opens its own, so one engine is alive at a time (a
backend may allow only one per process: vLLM with its engine core in-process).  The sequences run
past the zoo's 16-token windows: 40-token prompts and 24 new tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmdock import SamplingParams, UnsupportedError

from lmdock_conformance.families import OUTCOMES, first_divergence

NO_ZOO = ("the family tests run on a built zoo: python -m lmdock_conformance.zoo build DIR (torch and transformers), "
          "then pass --lmdock-zoo=DIR")


@pytest.fixture(scope="module")
def zoo_family(request: pytest.FixtureRequest) -> str:
    if request.param == "no-zoo":
        pytest.skip(NO_ZOO)
    return request.param


@pytest.fixture(scope="module")
def zoo(pytestconfig: pytest.Config) -> dict[str, Any]:
    from lmdock_conformance.zoo import read

    return read(pytestconfig.getoption("--lmdock-zoo"))


@pytest.fixture(scope="module")
def family_model(lmdock_setup: Any, pytestconfig: pytest.Config, zoo_family: str) -> str:
    """The family's checkpoint in the format the backend loads (a GGUF beside it, for llama.cpp)."""
    folder = Path(pytestconfig.getoption("--lmdock-zoo")) / zoo_family
    if "hf" in lmdock_setup.spec.model_formats:
        return str(folder)
    converted = pytestconfig.getoption("--lmdock-zoo-gguf")
    ggufs = sorted(folder.glob("*.gguf")) if converted is None else [p for p in [Path(converted) / f"{zoo_family}.gguf"] if p.is_file()]
    if not ggufs:
        why = _not_converted(converted, zoo_family)
        OUTCOMES.not_converted[zoo_family] = why
        pytest.skip(f"backend {lmdock_setup.backend!r} loads GGUF files and the zoo holds none for {zoo_family}: {why}")
    return str(ggufs[0])


def _not_converted(converted: str | None, family: str) -> str:
    """Why ``--lmdock-zoo-gguf``'s folder holds no GGUF for ``family`` (its gguf.json says)."""
    if converted is None:
        return "no --lmdock-zoo-gguf folder given (contrib/llamacpp/tools/zoo_gguf.py converts the zoo)"
    index = Path(converted) / "gguf.json"
    reasons = json.loads(index.read_text()).get("not_converted", {}) if index.is_file() else {}
    return reasons.get(family) or f"{converted} holds no {family}.gguf and its gguf.json gives no reason: convert the zoo again"


@pytest.fixture(scope="module")
def family_llm(lmdock_setup: Any, pytestconfig: pytest.Config, zoo_family: str, family_model: str) -> Iterator[Any]:
    """The family's engine, or None where the backend refused it at load (the reason is recorded)."""
    from lmdock._plugin.families import model_features

    found = model_features(family_model)
    if found is not None:
        OUTCOMES.features[zoo_family] = {"model_type": found.model_type, "features": sorted(found.features)}
    try:
        engine = _llm(lmdock_setup, pytestconfig, family_model)
    except UnsupportedError as exc:
        OUTCOMES.refused[zoo_family] = str(exc).replace(repr(family_model), "the model")  # the same on every machine
        yield None
        return
    yield engine
    engine.shutdown()


def _llm(setup: Any, config: pytest.Config, model: str, **extra: Any) -> Any:
    from lmdock import LLM

    if not config.getoption("--lmdock-zoo-probe"):
        return LLM(model, backend=setup.backend, **{**setup.options, **extra})
    with pytest.MonkeyPatch.context() as patch:  # what the engine does where nothing refuses the model
        patch.setattr("lmdock._plugin.declare.refuse_unsupported_family", lambda spec, model, max_seq_len=None: None)
        return LLM(model, backend=setup.backend, **{**setup.options, **extra})


def _loaded(family_llm: Any, family: str) -> Any:
    if family_llm is None:
        pytest.skip(f"refused at load: {OUTCOMES.refused[family]}")
    return family_llm


def _params(zoo: dict[str, Any]) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=zoo["max_new_tokens"], ignore_eos=True)


def _check(zoo: dict[str, Any], family: str, prompts: list[list[int]], outputs: list[Any], what: str) -> None:
    from lmdock_conformance.zoo import key

    refs = zoo["families"][family]["reference"]
    for prompt, out in zip(prompts, outputs, strict=True):
        diff = first_divergence(list(out.outputs[0].token_ids), refs[key(prompt)], zoo["tie_margin"])
        assert diff is None, f"{family}, {what}, {len(prompt)}-token prompt: {diff}"


def test_loads_or_is_refused_naming_the_family_and_the_missing_feature(lmdock_setup: Any, family_llm: Any, zoo_family: str,
                                                                       family_model: str) -> None:
    from lmdock._plugin.families import model_features

    found = model_features(family_model)
    spec = lmdock_setup.spec
    if family_llm is not None:
        assert family_llm.max_model_len > 0
        return
    reason = OUTCOMES.refused[zoo_family]
    assert found is not None and found.model_type in reason, reason
    lacked = [f for f in found.features if not spec.capability(f, found.model_type)[0]]
    if found.model_type in spec.refuses_families:
        assert spec.refuses_families[found.model_type] in reason, reason
    else:
        assert lacked and any(f"lacks {f!r}" in reason for f in lacked), f"refused without a declared reason: {reason}"


def test_single_prompt_past_the_window(family_llm: Any, zoo: dict[str, Any], zoo_family: str) -> None:
    llm = _loaded(family_llm, zoo_family)
    prompt = zoo["prompts"]["single"]
    assert len(prompt) + zoo["max_new_tokens"] > 2 * zoo["window"]
    _check(zoo, zoo_family, [prompt], llm.generate([prompt], _params(zoo)), "one prompt")


def test_mixed_length_batch_in_one_call(family_llm: Any, zoo: dict[str, Any], zoo_family: str) -> None:
    llm = _loaded(family_llm, zoo_family)
    prompts = zoo["prompts"]["batch"]
    _check(zoo, zoo_family, prompts, llm.generate(prompts, _params(zoo)), "a batch of four")


def test_requests_one_after_another_leak_no_state(family_llm: Any, zoo: dict[str, Any], zoo_family: str) -> None:
    llm = _loaded(family_llm, zoo_family)
    prompts = [zoo["prompts"]["single"], *zoo["prompts"]["batch"][::-1], zoo["prompts"]["single"]]
    for i, prompt in enumerate(prompts):
        _check(zoo, zoo_family, [prompt], llm.generate([prompt], _params(zoo)), f"request {i + 1} in a row")


def test_shared_prefix_with_prefix_caching(family_llm: Any, zoo: dict[str, Any], zoo_family: str) -> None:
    llm = _loaded(family_llm, zoo_family)
    for i, prompt in enumerate(zoo["prompts"]["prefix"]):
        _check(zoo, zoo_family, [prompt], llm.generate([prompt], _params(zoo)), f"shared prefix, request {i + 1}, prefix caching on")


def test_shared_prefix_without_prefix_caching(lmdock_setup: Any, pytestconfig: pytest.Config, family_llm: Any, family_model: str,
                                              zoo: dict[str, Any], zoo_family: str) -> None:
    _loaded(family_llm, zoo_family).shutdown()  # the family's last test (see the module's docstring)
    with _llm(lmdock_setup, pytestconfig, family_model, kv_cache={"enable_prefix_caching": False}) as llm:
        prompts = zoo["prompts"]["prefix"]
        for i, prompt in enumerate(prompts):
            _check(zoo, zoo_family, [prompt], llm.generate([prompt], _params(zoo)), f"shared prefix, request {i + 1}, prefix caching off")


def test_a_context_within_the_window_runs_without_one(lmdock_setup: Any, pytestconfig: pytest.Config, family_llm: Any,
                                                       family_model: str, zoo: dict[str, Any], zoo_family: str) -> None:
    """A backend without windows loads a windowed family when ``build.max_seq_len`` caps the context at the
    window (lmdock._plugin.families.ModelFeatures.within) and gives transformers' tokens up to that cap."""
    from lmdock._plugin.declare import family_refusal
    from lmdock._plugin.families import model_features

    found = model_features(family_model)
    if found is None or found.window is None:
        pytest.skip(f"{zoo_family} has no sliding window")
    spec = lmdock_setup.spec
    if spec.capability("sliding_window", found.model_type)[0]:
        pytest.skip(f"{spec.name} keeps {zoo_family}'s window: the tests above run past it")
    if why := family_refusal(spec, found.within(found.window), family_model):
        pytest.skip(f"refused for more than its window: {why}")
    assert family_llm is None  # refused at full length (for the window alone), so no engine of the family is alive
    prompt = zoo["prompts"]["batch"][0]
    room = found.window - len(prompt)
    try:
        llm = _llm(lmdock_setup, pytestconfig, family_model, build={"max_seq_len": found.window})
    except UnsupportedError as exc:  # the engine's own check at load (an architecture it does not implement)
        pytest.skip(f"refused at load with the context capped at the window: {exc}")
    with llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=room, ignore_eos=True))
    from lmdock_conformance.zoo import key

    ref = zoo["families"][zoo_family]["reference"][key(prompt)]
    diff = first_divergence(list(out[0].outputs[0].token_ids), {k: v[:room] for k, v in ref.items()}, zoo["tie_margin"])
    assert diff is None, f"{zoo_family}, a context capped at its {found.window}-token window: {diff}"
