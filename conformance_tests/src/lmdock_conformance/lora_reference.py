"""What a backend's LoRA tests against a reference share (lmdock-hf's against PEFT on transformers,
lmdock-mlx's against mlx-lm's own LoRA layers): the prompts and greedy parameters on stories260K, a
run read as its tokens and logprobs, the match within a tolerance, and the checks that need only a
backend's ``LLM``, the adapters and the reference's runs.

The reference itself is each plugin's (the engine the backend wraps, run directly); so is how its
adapters are made (PEFT's ``save_pretrained``, or :func:`lora_adapter` without PEFT).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lmdock import LLM, LoRARequest, RequestError, SamplingParams

# PEFT's folder format with random weights, for a reference that reads it (re-exported)
from lmdock_conformance._models import lora_adapter as lora_adapter

#: tokens each run generates
NEW = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0)
#: |lmdock - reference| logprob bound: both run float32, the add is the same sum in another order
TOL = 1e-4
#: token-id prompts for stories260K; the first is ../shared/models/README.md's "Once upon a time"
PROMPTS = [[1, 403, 407, 261, 378], [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]]
#: stories260K's greedy continuation of PROMPTS[0] (../shared/models/README.md)
GREEDY_16 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
#: the adapters each test module makes, by name ("a", "b"); None is the base model
NAMES = (None, "a", "b")

#: greedy tokens and the logprob of every token after the first (the prompt's, where asked, then the output's)
Run = tuple[list[int], list[float]]
#: the reference's runs, by (adapter name or None, index into PROMPTS)
Refs = Mapping[tuple[str | None, int], Run]


def reference_runs(reference: Callable[[Path | None, list[int]], Run], adapters: Mapping[str, Path]) -> dict[tuple[str | None, int], Run]:
    """``reference(adapter folder or None, prompt)`` for every adapter (and the base) and prompt."""
    return {(name, i): reference(adapters[name] if name else None, p) for name in NAMES for i, p in enumerate(PROMPTS)}


def refs_fixture(reference: Callable[[str, Path | None, list[int]], Run]) -> Any:
    """A test module's ``refs`` fixture (``refs = refs_fixture(_reference)``): ``reference(stories,
    adapter folder or None, prompt)``'s runs, by (adapter name or None, prompt index), from the module's
    ``stories`` and ``adapters`` fixtures."""
    import pytest

    @pytest.fixture(scope="module")
    def refs(stories: str, adapters: dict[str, Path]) -> dict[tuple[str | None, int], Run]:
        return reference_runs(lambda adapter, prompt: reference(stories, adapter, prompt), adapters)

    return refs


def lora_llm_fixture(backend: str) -> Any:
    """A test module's ``lora_llm`` fixture: stories260K on ``backend``, eight sequences at a time."""
    import pytest

    @pytest.fixture(scope="module")
    def lora_llm(stories: str) -> Iterator[LLM]:
        with LLM(stories, backend=backend, scheduler={"max_num_seqs": 8}) as llm:
            yield llm

    return lora_llm


def ran(out: Any) -> Run:
    """A ``RequestOutput`` read as a :data:`Run`, as lmdock reported it."""
    c = out.outputs[0]
    prompt = [] if out.prompt_logprobs is None else [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i > 0]
    return list(c.token_ids), prompt + [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def output_part(ref: Run) -> Run:
    """A reference run without its prompt's logprobs."""
    return ref[0], ref[1][-NEW:]


def assert_matches(got: Run, want: Run) -> None:
    import pytest

    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=TOL)


def lora(adapters: Mapping[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, adapters[name])


def check_the_adapters_change_the_output(refs: Refs) -> None:
    """The tests are meaningful: each adapter moves the greedy output and the logprobs away from the
    base model's, and the reference agrees with the model's known greedy output."""
    for i in range(len(PROMPTS)):
        for name in NAMES[1:]:
            assert refs[name, i][0] != refs[None, i][0]
            assert max(abs(x - y) for x, y in zip(refs[name, i][1], refs[None, i][1])) > 0.5
    assert refs[None, 0][0] == GREEDY_16


def check_each_adapter_matches(llm: LLM, adapters: Mapping[str, Path], refs: Refs, merged: Callable[[Path], Run],
                               merged_names: tuple[str, ...] = ("a", "b")) -> None:
    """Each adapter on each prompt matches the reference's unmerged run; on the first prompt, for
    ``merged_names``, also ``merged(adapter folder)``: the reference with the adapter fused in."""
    for name in NAMES[1:]:
        for i, prompt in enumerate(PROMPTS):
            assert_matches(ran(llm.generate([prompt], GREEDY, lora_request=lora(adapters, name))[0]), refs[name, i])
    for name in merged_names:
        assert_matches(ran(llm.generate([PROMPTS[0]], GREEDY, lora_request=lora(adapters, name))[0]), merged(adapters[name]))


def check_a_mixed_batch(llm: LLM, adapters: Mapping[str, Path], refs: Refs) -> None:
    """Base, adapter a and adapter b (two prompts each) in one batch each match the reference."""
    loras = [None, lora(adapters, "a"), lora(adapters, "b")] * 2
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    for out, req, prompt in zip(llm.generate(prompts, GREEDY, lora_request=loras), loras, prompts):
        assert_matches(ran(out), refs[req.name if req else None, PROMPTS.index(prompt)])


def check_the_prefix_cache_is_not_shared(llm: LLM, adapters: Mapping[str, Path], refs: Refs) -> None:
    """A prompt computed under adapter a is cached; the same prompt under b or the base model must not
    reuse it (their KV state differs), and under a it is reused."""
    plain = GREEDY.replace(prompt_logprobs=None)  # prompt logprobs turn the reuse off
    hits = lambda: llm.stats()["prefix_cache_hit_tokens"]  # noqa: E731
    assert_matches(ran(llm.generate([PROMPTS[1]], GREEDY, lora_request=lora(adapters, "a"))[0]), refs["a", 1])
    before = hits()
    assert_matches(ran(llm.generate([PROMPTS[1]], plain, lora_request=lora(adapters, "b"))[0]), output_part(refs["b", 1]))
    assert_matches(ran(llm.generate([PROMPTS[1]], plain)[0]), output_part(refs[None, 1]))
    assert hits() == before  # neither b nor the base reused a's cached prompt
    out = llm.generate([PROMPTS[1]], plain, lora_request=lora(adapters, "a"))[0]
    assert hits() > before  # a's own prompt is reused under a
    assert_matches(ran(out), output_part(refs["a", 1]))


def check_max_loras_one_evicts_and_reloads(llm: LLM, adapters: Mapping[str, Path], refs: Refs) -> Any:
    """On an ``LLM`` with ``build.max_loras = 1``: a, b, a each match, and a was read twice (the step
    engine's ``lmdock.backend.AdapterCache``).  Returns that cache."""
    for name in ("a", "b", "a"):
        assert_matches(ran(llm.generate([PROMPTS[0]], GREEDY, lora_request=lora(adapters, name))[0]), refs[name, 0])
    store = llm.engine.engine.adapters
    assert len(store.loaded) == 1 and store.loads == 3
    assert llm.engine.engine.max_loras == 1  # what /metrics reports
    return store


def check_a_bad_adapter_fails_alone(llm: LLM, adapters: Mapping[str, Path], refs: Refs, missing: Path,
                                    bad: Mapping[str, tuple[Path, str]] = {}) -> None:  # noqa: B006 - read only
    """An adapter folder without ``adapter_config.json`` (``missing``), and each ``bad`` adapter (its
    folder and the refusal's pattern), fail their own request at submit while a good one runs on."""
    import pytest

    with pytest.raises(RequestError, match=r"lora_request 'nope': .*adapter_config.json does not exist"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("nope", missing))
    good = llm.generate_async(PROMPTS[0], GREEDY, lora_request=lora(adapters, "a"))
    for name, (folder, match) in {"nope": (missing, "nope"), **bad}.items():
        with pytest.raises(RequestError, match=match):
            llm.generate_async(PROMPTS[0], GREEDY, lora_request=LoRARequest(name, folder))
    assert_matches(ran(good.result(timeout=120)), refs["a", 0])


class LoRAReferenceTests:
    """The LoRA tests that need only a backend's name, its adapters and its reference: a test module
    subclasses this as ``Test...`` beside its ``stories``, ``adapters``, ``refs`` and ``lora_llm``
    fixtures, and sets ``backend`` and ``reference``."""

    #: the backend under test
    backend: str
    #: ``reference(stories, adapter folder or None, prompt, merged=False)``: the reference's :data:`Run`
    reference: Callable[..., Run]
    #: the adapters whose merged (fused) reference is checked too
    merged_names: tuple[str, ...] = ("a", "b")

    def bad_adapters(self, stories: str, folder: Path) -> dict[str, tuple[Path, str]]:
        """Adapters (written under ``folder``) the backend refuses at submit, each with the refusal's
        pattern, beyond a folder without ``adapter_config.json``."""
        return {}

    def test_the_adapters_change_the_output(self, refs: Refs) -> None:
        check_the_adapters_change_the_output(refs)

    def test_an_adapter_matches_the_reference_unmerged_and_merged(self, lora_llm: LLM, adapters: Mapping[str, Path], refs: Refs,
                                                                   stories: str) -> None:
        check_each_adapter_matches(lora_llm, adapters, refs, lambda adapter: self.reference(stories, adapter, PROMPTS[0], merged=True),
                                   self.merged_names)

    def test_the_prefix_cache_is_not_shared_across_adapters(self, stories: str, adapters: Mapping[str, Path], refs: Refs) -> None:
        with LLM(stories, backend=self.backend) as llm:
            check_the_prefix_cache_is_not_shared(llm, adapters, refs)

    def test_max_loras_evicts_and_reloads(self, stories: str, adapters: Mapping[str, Path], refs: Refs) -> None:
        with LLM(stories, backend=self.backend, build={"max_loras": 1}) as llm:
            check_max_loras_one_evicts_and_reloads(llm, adapters, refs)

    def test_a_bad_adapter_fails_its_request_alone(self, lora_llm: LLM, adapters: Mapping[str, Path], refs: Refs, tmp_path: Path,
                                                   stories: str) -> None:
        check_a_bad_adapter_fails_alone(lora_llm, adapters, refs, tmp_path, self.bad_adapters(stories, tmp_path / "bad"))
