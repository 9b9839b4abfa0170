"""Speculative decoding in the loop (issue 42), on the FAKE step backend (core plumbing only; the real
engine runs in plugins/hf/tests/test_speculative.py and the conformance suite).

The FAKE engine checks that every chunk starts where the sequence's KV state ends, so a rejected draft
left in its state (a missing ``truncate``) fails the step.  Its logits do not depend on the chunk's
width, so speculation on and off must give the same tokens exactly, sampled ones included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes import PIECES, FakePlugin, FakeStepEngine
from lmdock import LLM, ConfigError, SamplingParams
from lmdock import hookimpl as lmdock_hookimpl
from lmdock._config.speculative import SpeculativeConfig
from lmdock._engine.proposers import NgramIndex
from lmdock._plugin import manager as _plugins
from lmdock.backend import BackendSpec

pytestmark = pytest.mark.usefixtures("host_overlap")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": None}
PROMPTS = ["abcabcab", "hello hello hel", "the cat the cat the", "xyz"]


class CuttingEngine(FakeStepEngine):
    """The FAKE engine with ``truncate`` (its state is a token list: cutting it is exact)."""

    def __init__(self, *args: Any, can_cut: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.can_cut = can_cut
        self.cuts = 0

    def truncate(self, seq_id: int, length: int) -> bool:
        if not self.can_cut:
            return False
        self.cuts += 1
        del self.state[seq_id][length:]
        return True


def repetitive(tokens: list[int]) -> np.ndarray:
    """Logits that favour repeating the token three back (text with things to look up), noisy enough
    that samples differ from the argmax."""
    rng = np.random.default_rng(len(tokens) * 7919 + tokens[-1])
    row = rng.normal(0, 1.0, len(PIECES)).astype(np.float32)
    if len(tokens) >= 3:
        row[tokens[-3]] += 4.0
    return row


class Plugin(FakePlugin):
    """The FAKE backend, declaring what these tests exercise."""

    @lmdock_hookimpl
    def lmdock_register_backends(self, register: Any) -> None:
        caps = frozenset({"generate", "sampling", "logprobs", "logit_bias", "beam_search"})
        register(BackendSpec(name="fake", kind="step", plugin_api="1.0", supports=caps, description="FAKE test backend"))


def plugin(**kwargs: Any) -> FakePlugin:
    fake = Plugin(lambda: CuttingEngine(repetitive, **kwargs))
    _plugins.get_registry().add_plugin(fake, "fake")
    return fake


def run(params: SamplingParams, spec: dict[str, Any] | None, prompts: list[str] = PROMPTS, **options: Any) -> tuple[list[Any], dict[str, Any]]:
    with LLM("m", backend="fake", speculative_config=spec, **options) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert llm.engine.engine.num_sequences() - stats["num_sequences_cached"] == 0
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], stats


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
    "stop string": SamplingParams(temperature=0, max_tokens=40, stop=["ca"], ignore_eos=True),
    "stop token": SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[PIECES.index("t")], ignore_eos=True),
    "penalties": SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
    "logit bias": SamplingParams(temperature=0, max_tokens=30, logit_bias={PIECES.index("a"): 5.0}, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.7, seed=3, max_tokens=20, logprobs=3, ignore_eos=True),
    "short": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_speculation_on_gives_the_tokens_of_speculation_off(isolated: Any, name: str) -> None:
    plugin()
    off, _ = run(PARAMS[name], None)
    on, stats = run(PARAMS[name], NGRAM)
    assert on == off
    if name != "short":  # three tokens leave no room to propose
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_logprobs_per_accepted_token_match(isolated: Any) -> None:
    plugin()
    params = PARAMS["logprobs"]
    with LLM("m", backend="fake") as llm:
        off = llm.generate(PROMPTS, params)
    with LLM("m", backend="fake", speculative_config=NGRAM) as llm:
        on = llm.generate(PROMPTS, params)
        assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(off, on):
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob)


def test_n_completions_and_batches_keep_their_semantics(isolated: Any) -> None:
    plugin()
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=25, ignore_eos=True)
    off, _ = run(params, None, scheduler={"max_num_seqs": 3})
    on, stats = run(params, NGRAM, scheduler={"max_num_seqs": 3})
    assert on == off and stats["spec_decode_num_accepted_tokens"] > 0


def test_the_token_budget_bounds_the_drafts(isolated: Any) -> None:
    fake = plugin()
    params = PARAMS["greedy"]
    off, _ = run(params, None)
    on, stats = run(params, NGRAM, scheduler={"max_num_batched_tokens": 6, "max_num_seqs": 4})
    assert on == off
    # every step's chunks stayed within the budget: the FAKE engine saw at most 6 positions per step
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert fake.engines[-1].cuts > 0


def test_disable_by_batch_size_turns_proposals_off(isolated: Any) -> None:
    plugin()
    assert SpeculativeConfig(method="ngram").disable_by_batch_size == 4  # lmdock's default (docs/speculative.md)
    _, stats = run(PARAMS["greedy"], {**NGRAM, "disable_by_batch_size": 2})
    assert stats["spec_decode_num_drafts"] == 0  # four prompts run together: no step speculated
    _, stats = run(PARAMS["greedy"], {**NGRAM, "disable_by_batch_size": 2}, prompts=PROMPTS[:1])
    assert stats["spec_decode_num_drafts"] > 0


def test_an_engine_without_truncate_runs_without_speculation(isolated: Any) -> None:
    _plugins.get_registry().add_plugin(Plugin(lambda: FakeStepEngine(repetitive)), "fake")
    on, stats = run(PARAMS["greedy"], NGRAM)
    assert stats["spec_decode_num_drafts"] == 0
    assert "truncate" in stats["spec_decode_off"]
    off, _ = run(PARAMS["greedy"], None)
    assert on == off


def test_a_truncate_that_refuses_recomputes_the_sequence_and_turns_speculation_off(isolated: Any) -> None:
    fake = plugin(can_cut=False)
    on, stats = run(PARAMS["greedy"], NGRAM)
    assert "truncate" in stats["spec_decode_off"]
    assert fake.engines[-1].restarts > 0  # the sequence holding rejected drafts was computed again
    off, _ = run(PARAMS["greedy"], None)
    assert on == off


class BrokenProposer:
    @lmdock_hookimpl(tryfirst=True)
    def lmdock_speculative_proposer(self, config: Any, engine: Any, model_config: Any) -> Any:
        class Fails:
            def propose(self, seqs: Any, limits: Any) -> Any:
                raise RuntimeError("boom")

            def accepted(self, seq: Any, kept: int) -> None: ...
            def close(self) -> None: ...

        return Fails() if config.method == "broken" else None


def test_a_failing_proposer_turns_speculation_off_and_requests_go_on(isolated: Any) -> None:
    plugin()
    _plugins.get_registry().add_plugin(BrokenProposer(), "broken")
    on, stats = run(PARAMS["greedy"], {"method": "broken", "disable_by_batch_size": None})
    assert "boom" in stats["spec_decode_off"]
    off, _ = run(PARAMS["greedy"], None)
    assert on == off


def test_an_unknown_method_is_refused_at_load(isolated: Any) -> None:
    fake = plugin()
    with pytest.raises(ConfigError, match="no plugin proposes with speculative method 'eagle'"):
        LLM("m", backend="fake", speculative_config={"method": "eagle"})
    assert fake.engines[-1].closed


def test_beam_search_runs_without_speculation(isolated: Any) -> None:
    plugin()
    from lmdock import BeamSearchParams

    with LLM("m", backend="fake") as llm:
        off = llm.beam_search(["abcabc"], BeamSearchParams(beam_width=2, max_tokens=10))
    with LLM("m", backend="fake", speculative_config=NGRAM) as llm:
        on = llm.beam_search(["abcabc"], BeamSearchParams(beam_width=2, max_tokens=10))
        assert llm.engine.stats()["spec_decode_num_drafts"] == 0
    assert [s.tokens for s in on[0].sequences] == [s.tokens for s in off[0].sequences]


def test_config_takes_vllm_names_and_refuses_bad_values(isolated: Any) -> None:
    assert SpeculativeConfig().enabled is False
    from lmdock._config.file import model_config

    mc = model_config({"model": "m", "speculative": {"method": "ngram", "ngram_prompt_lookup_max": 7, "ngram_prompt_lookup_min": 3}})
    assert (mc.speculative.prompt_lookup_min, mc.speculative.prompt_lookup_max) == (3, 7)
    assert model_config({"model": "m", "speculative": {"model": "draft-folder"}}).speculative.method == "draft"
    assert model_config({"model": "m", "speculative": {"method": "draft_model", "model": "d"}}).speculative.method == "draft"
    assert model_config({"model": "m", "speculative": {"model": "[ngram]"}}).speculative.method == "ngram"
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        model_config({"model": "m", "speculative": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}})
    with pytest.raises(ConfigError, match="speculative.model"):
        model_config({"model": "m", "speculative": {"method": "draft"}})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        model_config({"model": "m", "speculative": {"method": "ngram", "num_speculative_tokens": 0}})
    with pytest.raises(ConfigError, match="speculative.lookahead"):
        model_config({"model": "m", "speculative": {"method": "ngram", "lookahead": 3}})


def test_ngram_index_finds_the_longest_suffix_at_its_latest_occurrence() -> None:
    idx = NgramIndex(1, 3)
    seq = [5, 1, 2, 9, 1, 2, 3, 7, 1, 2]
    # the suffix (1, 2) occurred ending at 2 and 5; (7, 1, 2) never before: the latest (1, 2) wins
    assert idx.lookup(seq, 3) == [3, 7, 1]
    seq += [3]  # suffix (1, 2, 3) occurred ending at 6
    assert idx.lookup(seq, 2) == [7, 1]
    assert NgramIndex(2, 2).lookup([4, 5, 6], 3) == []  # nothing to look up


class ScriptedProposer:
    """A proposer whose drafts are all right (the FAKE engine's greedy chain) or all wrong (a token
    greedy never picks there); it records the limit of each proposal."""

    def __init__(self) -> None:
        self.limits: list[int] = []

    @lmdock_hookimpl(tryfirst=True)
    def lmdock_speculative_proposer(self, config: Any, engine: Any, model_config: Any) -> Any:
        if config.method not in ("right", "wrong"):
            return None
        recorder = self

        class Scripted:
            def propose(self, seqs: Any, limits: Any) -> list[list[int]]:
                out = []
                for seq, k in zip(seqs, limits):
                    recorder.limits.append(k)
                    tokens, draft = list(seq.token_ids), []
                    for _ in range(k):
                        row = repetitive(tokens)
                        draft.append(int(row.argmax() if config.method == "right" else row.argmin()))
                        tokens.append(draft[-1])
                    out.append(draft)
                return out

            def accepted(self, seq: Any, kept: int) -> None: ...
            def close(self) -> None: ...

        return Scripted()


@pytest.mark.parametrize("method", ["right", "wrong"])
def test_the_draft_length_adapts_to_what_was_kept(isolated: Any, method: str) -> None:
    """transformers' heuristic schedule: +2 after a proposal kept whole (up to k), -1 otherwise (down to 1);
    then a rejected one-draft proposal makes the sequence wait 1, 2, 4 ... steps."""
    plugin()
    scripted = ScriptedProposer()
    _plugins.get_registry().add_plugin(scripted, "scripted")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    on, stats = run(params, {"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": None}, prompts=PROMPTS[:1])
    off, _ = run(params, None, prompts=PROMPTS[:1])
    assert on == off
    if method == "right":  # every draft kept: each proposal as long as k and max_tokens allow
        assert scripted.limits[:5] == [4, 4, 4, 4, 4]
        assert stats["spec_decode_acceptance_rate"] == 1.0
    else:  # nothing kept: 4, 3, 2, 1 drafts, then one-draft proposals with waits of 1, 2, 4, 8 steps between
        assert scripted.limits == [4, 3, 2, 1] + [1] * (len(scripted.limits) - 4)
        # 39 decoding steps: proposals at steps 1-4, then at 6, 9, 14 and 23 (after waits of 1, 2, 4 and 8
        # steps); the next wait, 16 steps, outlasts the request
        assert len(scripted.limits) == 4 + 4
        assert stats["spec_decode_num_accepted_tokens"] == 0


def test_the_per_sequence_state_of_ended_sequences_is_pruned(isolated: Any, monkeypatch: Any) -> None:
    from lmdock._engine import speculative

    monkeypatch.setattr(speculative, "FORGET_AT", 2)
    plugin()
    with LLM("m", backend="fake", speculative_config=NGRAM) as llm:
        for prompt in PROMPTS * 2:  # one at a time: each ends before the next starts
            llm.generate([prompt], PARAMS["greedy"])
        spec = llm.engine.spec
        assert spec.num_drafts > 0
        assert len(spec._wait) <= 3 and len(spec._length) <= 3  # pruned to the step's sequence, plus the last one's
