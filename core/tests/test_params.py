from __future__ import annotations

import pytest
from lmdock import BuildConfig, KvCacheConfig, OffloadPolicy, QuantConfig, SamplingParams, SchedulerConfig

BAD_SAMPLING = [
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 1.1),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("max_new_tokens", 0),
    ("min_new_tokens", -1),
    ("n", 0),
    ("seed", -5),
    ("logprobs", -1),
    ("prompt_logprobs", -1),
    ("beam_width", 0),
    ("stop_token_ids", (-1,)),
    ("stop", ("",)),
    ("logit_bias", {5: 101}),
    ("logit_bias", {5: -100.5}),
    ("logit_bias", {"five": 1}),
    ("logit_bias", {-3: 1}),
    ("logit_bias", {5: True}),
    ("logit_bias", [5, 1]),
    ("allowed_token_ids", ()),
    ("allowed_token_ids", (3, -1)),
    ("bad_words", ("ok", " ")),
]


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_invalid_sampling_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**{field: value})


def test_token_fields_normalise_json_keys_and_lists() -> None:
    p = SamplingParams(logit_bias={"432": -100, 7: 2}, allowed_token_ids=[3, 4], bad_words="Lily")
    assert p.logit_bias == {432: -100.0, 7: 2.0} and p.allowed_token_ids == (3, 4) and p.bad_words == ("Lily",)
    assert p.biased and not SamplingParams().biased
    assert SamplingParams(logit_bias={}).logit_bias == {} and SamplingParams().allowed_token_ids is None
    assert hash(p) == hash(SamplingParams(logit_bias={7: 2, 432: -100}, allowed_token_ids=(3, 4), bad_words=("Lily",)))


def test_min_new_tokens_cannot_exceed_max() -> None:
    with pytest.raises(ValueError, match="min_new_tokens: must be <= max_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_sampling_normalises_vllm_spellings() -> None:
    p = SamplingParams(top_k=-1, stop="END", stop_token_ids=[7])
    assert p.top_k == 0 and p.stop == ("END",) and p.stop_token_ids == (7,)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (QuantConfig, "group_size", 48),
        (BuildConfig, "max_batch_size", 0),
        (BuildConfig, "tensor_parallel_size", 0),
        (KvCacheConfig, "memory_fraction", 1.5),
        (SchedulerConfig, "max_num_seqs", 0),
        (OffloadPolicy, "weights_gpu_percent", 120.0),
    ],
)
def test_invalid_portable_values_name_the_field(cls: type, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        cls(**{field: value})


def test_offload_policy_validates_and_reports_the_disk_share() -> None:
    with pytest.raises(ValueError, match="weights_cpu_percent"):
        OffloadPolicy(weights_gpu_percent=50, weights_cpu_percent=60)
    with pytest.raises(ValueError, match="compress_group_size"):
        OffloadPolicy(compress_group_size=63)
    with pytest.raises(ValueError, match="memory_budget_gib"):
        OffloadPolicy(memory_budget_gib=0)
    policy = OffloadPolicy(weights_gpu_percent=50, weights_cpu_percent=20)  # offload_dir defaults to the cache
    assert policy.enabled and policy.disk_percent == 30
    assert not OffloadPolicy().enabled
    assert OffloadPolicy(compress_weight=True).enabled


def test_structured_output_takes_exactly_one_constraint() -> None:
    from lmdock import StructuredOutput

    assert SamplingParams(structured_output={"choice": ["yes", "no"]}).structured_output == StructuredOutput(choice=("yes", "no"))
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar; got json, regex"):
        StructuredOutput(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()


def test_openais_field_names_are_one_table_behind_samplingparams_aliases() -> None:
    import dataclasses

    from lmdock._config.foreign import OPENAI_FIELDS

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(OPENAI_FIELDS.values()) <= fields
    aliases = SamplingParams.ALIASES  # type: ignore[attr-defined]
    assert all(aliases[name] == field for name, field in OPENAI_FIELDS.items() if name != field)
    assert SamplingParams(max_tokens=3, min_tokens=1).max_new_tokens == 3
