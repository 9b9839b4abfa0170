"""LoRARequest plumbing through the core (issue 33): the capability gate, the adapter on each chunk, a
bad adapter failing its request alone, and the prompt cache keyed by adapter.  FAKE engine (core
plumbing only): its "adapter" adds a fixed row to the logits; real adapters are tested in lmdock-hf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdock
import pytest
from fakes import FakeStepEngine
from lmdock import LLM, LoRARequest, RequestError, SamplingParams, UnsupportedError
from lmdock._engine.prefix_cache import PromptCache
from lmdock._plugin import manager as _plugins
from lmdock.backend import BackendSpec, SeqChunk, StepOutput

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]


class FakeLoraEngine(FakeStepEngine):
    """The FAKE engine with "adapters": an adapter named ``bias-T`` makes token T the argmax."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[str] = []
        self.seen: list[tuple[int, int, str | None]] = []  # (seq_id, start, adapter name) per chunk

    def prepare_lora(self, lora: LoRARequest) -> None:
        if not lora.name.startswith("bias-"):
            raise FileNotFoundError(f"no adapter_config.json in {lora.path}")
        self.prepared.append(lora.name)

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        out = super().step(chunks)
        for i, c in enumerate(chunks):
            self.seen.append((c.seq_id, c.start, c.lora.name if c.lora else None))
            if c.lora is not None:
                out.last[i, int(c.lora.name.split("-")[1])] += 100.0
        return out

    def fork(self, src: int, dst: int, length: int) -> bool:
        self.state[dst] = list(self.state[src][:length])
        return True


class FakeLoraPlugin:
    def __init__(self) -> None:
        self.engines: list[FakeLoraEngine] = []

    @lmdock.hookimpl
    def lmdock_register_backends(self, register: Any) -> None:
        register(BackendSpec(name="fakelora", kind="step", plugin_api="1.0", supports=frozenset({"generate", "lora"}), description="FAKE test backend with adapters"))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend: str, model_config: Any, options: Any, quantization: Any, build: Any) -> Any:
        if backend != "fakelora":
            return None
        self.engines.append(FakeLoraEngine())
        return self.engines[-1]


@pytest.fixture
def fakelora(isolated: Any) -> FakeLoraPlugin:
    plugin = FakeLoraPlugin()
    _plugins.get_registry().add_plugin(plugin, "fakelora")
    return plugin


def test_vllm_argument_names_are_aliases() -> None:
    assert LoRARequest("sql", 1, "/a/sql") == LoRARequest(lora_name="sql", lora_int_id=1, lora_path="/a/sql") == LoRARequest("sql", path="/a/sql", int_id=1)
    lora = LoRARequest("sql", "/a/sql")
    assert (lora.lora_name, lora.lora_path, lora.lora_int_id) == ("sql", "/a/sql", None)
    with pytest.raises(RequestError, match="disagree"):
        LoRARequest("sql", "/a", lora_path="/b")
    with pytest.raises(RequestError, match="needs the adapter's path"):
        LoRARequest("sql")


def test_a_backend_without_lora_refuses_it_by_name(fake: Any) -> None:
    with LLM("m", backend="fake") as llm:
        with pytest.raises(UnsupportedError, match=r"lora_request: backend 'fake' cannot run LoRA adapters .*does not declare 'lora'"):
            llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("a", "/x"))
        with pytest.raises(UnsupportedError, match="lora_request"):
            list(llm.stream(PROMPT, GREEDY, lora_request=LoRARequest("a", "/x")))
        assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids  # without one it runs


def test_each_prompt_runs_under_its_own_adapter_in_one_batch(fakelora: FakeLoraPlugin) -> None:
    with LLM("m", backend="fakelora", kv_cache={"enable_prefix_caching": False}) as llm:
        base = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
        a, b = LoRARequest("bias-20", "/a"), LoRARequest("bias-21", "/b")
        outs = llm.generate([PROMPT, PROMPT, PROMPT], GREEDY, lora_request=[None, a, b])
        engine = fakelora.engines[-1]
    assert outs[0].outputs[0].token_ids == base
    assert outs[1].outputs[0].token_ids == [20] * 6
    assert outs[2].outputs[0].token_ids == [21] * 6
    assert engine.prepared == ["bias-20", "bias-21"]
    with pytest.raises(RequestError, match="got 2 lora_request entries for 3 prompts"):
        llm.generate([PROMPT] * 3, GREEDY, lora_request=[a, b])


def test_an_adapter_that_cannot_load_fails_its_request_alone(fakelora: FakeLoraPlugin) -> None:
    with LLM("m", backend="fakelora") as llm:
        with pytest.raises(RequestError, match=r"lora_request 'missing': the adapter at '/nowhere' could not be loaded \(FileNotFoundError"):
            llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("missing", "/nowhere"))
        assert llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("bias-20", "/a"))[0].outputs[0].token_ids == [20] * 6


def test_a_cached_prompt_is_reused_under_its_own_adapter_only(fakelora: FakeLoraPlugin) -> None:
    with LLM("m", backend="fakelora") as llm:
        a, b = LoRARequest("bias-20", "/a"), LoRARequest("bias-21", "/b")
        engine = fakelora.engines[-1]
        runs = {}
        for name, lora in (("a", a), ("b", b), ("base", None), ("a again", a)):
            engine.seen.clear()
            llm.generate([PROMPT], GREEDY, lora_request=lora)
            runs[name] = engine.seen[0][1]  # where the first chunk started: > 0 is a prefix-cache hit
    assert runs == {"a": 0, "b": 0, "base": 0, "a again": len(PROMPT) - 1}


def test_prompt_cache_tries_are_per_adapter() -> None:
    cache = PromptCache()
    cache.insert([1, 2, 3], 10, adapter=("a", "/a"))
    assert cache.lookup([1, 2, 3, 4], adapter=("b", "/b")) == (None, 0)
    assert cache.lookup([1, 2, 3, 4]) == (None, 0)
    assert cache.lookup([1, 2, 3, 4], adapter=("a", "/a")) == (10, 3)
    cache.insert([1, 2], 11)
    assert cache.evict(3) == ([10], 3)
    assert list(cache.roots) == [None]  # the adapter's trie went with its last prompt


def test_a_vllm_lora_request_object_is_read_by_its_attributes(fakelora: FakeLoraPlugin) -> None:
    class VllmLoRARequest:  # vllm.lora.request.LoRARequest's attributes
        lora_name, lora_int_id, lora_path = "bias-22", 3, "/c"

    with LLM("m", backend="fakelora") as llm:
        out = llm.generate([PROMPT], GREEDY, lora_request=VllmLoRARequest())[0]
    assert out.outputs[0].token_ids == [22] * 6


def test_lora_limits_on_a_backend_without_lora_are_refused(fake: Any) -> None:
    with pytest.raises(UnsupportedError, match=r"build.max_loras: backend 'fake' cannot run LoRA adapters"):
        LLM("m", backend="fake", build={"max_loras": 2})
    with pytest.raises(lmdock.ConfigError, match="max_lora_rank"):
        LLM("m", backend="fake", build={"max_lora_rank": 0})


def test_lora_limits_reach_a_backend_with_lora(fakelora: FakeLoraPlugin) -> None:
    with LLM("m", backend="fakelora", build={"max_loras": 2, "max_lora_rank": 8}) as llm:
        assert (llm.model_config.build.max_loras, llm.model_config.build.max_lora_rank) == (2, 8)


def test_an_adapter_declared_in_the_config_is_named_by_its_name(fakelora: FakeLoraPlugin, isolated: Any) -> None:
    (isolated / "lmdock.toml").write_text('[models.m]\nmodel = "m"\nbackend = "fakelora"\n[models.m.adapters]\n"bias-20" = "adapters/b20"\n')
    with LLM("m") as llm:
        assert llm.model_config.adapters == {"bias-20": str(isolated / "adapters" / "b20")}
        assert llm.generate([PROMPT], GREEDY, lora_request="bias-20")[0].outputs[0].token_ids == [20] * 6
        with pytest.raises(RequestError, match=r"lora_request 'sql': the model declares no such adapter \(declared: bias-20\)"):
            llm.generate([PROMPT], GREEDY, lora_request="sql")


def test_declared_adapters_on_a_backend_without_lora_are_refused(fake: Any, isolated: Any) -> None:
    (isolated / "lmdock.toml").write_text('[models.m]\nmodel = "m"\nbackend = "fake"\n[models.m.adapters]\nsql = "a"\n')
    with pytest.raises(UnsupportedError, match=r"\[models.NAME.adapters\]: backend 'fake' cannot run LoRA adapters"):
        LLM("m")
    (isolated / "lmdock.toml").write_text('[models.m]\nmodel = "m"\nbackend = "fake"\n[models.m.adapters]\n"a:b" = "a"\n')
    with pytest.raises(lmdock.ConfigError, match="an adapter name is 1 to 64 letters"):
        LLM("m")


def test_stats_name_the_adapters_of_running_and_waiting_requests(fakelora: FakeLoraPlugin) -> None:
    """vLLM's lora_requests_info, from the loop: one request runs under bias-20, the other (bias-21)
    waits for the only batch slot; the engine's second step is held until the check."""
    import threading

    with LLM("m", backend="fakelora", scheduler={"max_num_seqs": 1}) as llm:
        engine = fakelora.engines[-1]
        entered = [threading.Event(), threading.Event()]
        go = [threading.Event(), threading.Event()]
        calls = []
        step = engine.step

        def held_step(chunks: Sequence[SeqChunk]) -> StepOutput:
            n = len(calls)
            calls.append(n)
            if n < 2:
                entered[n].set()
                go[n].wait(30)
            return step(chunks)

        engine.step = held_step  # type: ignore[method-assign]
        first = llm.generate_async(PROMPT, GREEDY, lora_request=LoRARequest("bias-20", "/a"))
        assert entered[0].wait(30)
        second = llm.generate_async(PROMPT, GREEDY, lora_request=LoRARequest("bias-21", "/b"))
        go[0].set()  # the loop takes the second request in before its next step
        assert entered[1].wait(30)
        stats = llm.stats()
        assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"], stats["max_lora"]) == ("bias-20", "bias-21", 0)
        go[1].set()
        first.result(timeout=30), second.result(timeout=30)
        stats = llm.stats()
    assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"]) == ("", "")


# -- read_lora_adapter: the PEFT folder rules lmdock-hf and lmdock-mlx share --------------------


def _peft_folder(folder: Any, config: dict[str, Any], shapes: dict[str, list[int]]) -> Any:
    """A PEFT folder whose safetensors file has these tensors (zeros; only the header is read)."""
    import json
    import struct

    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return folder


def _ab(module: str, r: int, out_f: int = 8, in_f: int = 8) -> dict[str, list[int]]:
    return {f"base_model.model.{module}.lora_A.weight": [r, in_f], f"base_model.model.{module}.lora_B.weight": [out_f, r]}


def test_read_lora_adapter_gives_modules_shapes_and_peft_scales(tmp_path: Any) -> None:
    from lmdock.backend import read_lora_adapter

    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"o_proj": 2}}
    folder = _peft_folder(tmp_path / "a", config, {**_ab("layers.0.q_proj", 4), **_ab("layers.0.v_proj", 2), **_ab("layers.0.o_proj", 4)})
    weights, modules = read_lora_adapter(LoRARequest("a", folder))
    assert weights == str(folder / "adapter_model.safetensors")
    got = {m.name: (m.lora_a, m.a_shape, m.b_shape, m.scale) for m in modules}
    assert got == {
        "layers.0.q_proj": ("base_model.model.layers.0.q_proj.lora_A.weight", (4, 8), (8, 4), 2.0),
        "layers.0.v_proj": ("base_model.model.layers.0.v_proj.lora_A.weight", (2, 8), (8, 2), 4.0),
        "layers.0.o_proj": ("base_model.model.layers.0.o_proj.lora_A.weight", (4, 8), (8, 4), 0.5),
    }
    rs = _peft_folder(tmp_path / "rs", {"r": 4, "lora_alpha": 8, "use_rslora": True}, _ab("q_proj", 4))
    assert [m.scale for m in read_lora_adapter(LoRARequest("rs", rs))[1]] == [4.0]


@pytest.mark.parametrize(("config", "shapes", "match"), [
    ({"r": 4, "use_dora": True}, _ab("q_proj", 4), r"sets use_dora \(other than False\), which lmdock does not implement"),
    ({"r": 4, "peft_type": "IA3"}, _ab("q_proj", 4), "peft_type is not LORA: not a LoRA adapter"),
    ({"r": "4"}, _ab("q_proj", 4), "r must be a positive integer"),
    ({"r": 4, "rank_pattern": {"(a+)+X": 2}}, _ab("q_proj", 4), "rank_pattern has a key that is not a module name"),
    ({"r": 4, "alpha_pattern": {"q_proj": "x"}}, _ab("q_proj", 4), "alpha_pattern must be a positive number"),
    ({"r": 4}, {"base_model.model.embed_tokens.weight": [8, 8]}, "'base_model.model.embed_tokens.weight' is not a lora_A / lora_B weight"),
    ({"r": 4}, {"base_model.model.q_proj.lora_A.weight": [4, 8]}, "module 'q_proj' lacks lora_B"),
    ({"r": 4}, {}, "holds no lora_A / lora_B weights"),
])
def test_read_lora_adapter_refuses_what_lmdock_does_not_run(tmp_path: Any, config: dict[str, Any], shapes: dict[str, list[int]], match: str) -> None:
    from lmdock.backend import read_lora_adapter

    with pytest.raises(RequestError, match=rf"lora_request 'x': .*{match}"):
        read_lora_adapter(LoRARequest("x", _peft_folder(tmp_path / "x", config, shapes)))


def test_a_lora_module_is_checked_against_the_models_layer(tmp_path: Any) -> None:
    from lmdock.backend import read_lora_adapter

    lora = LoRARequest("x", _peft_folder(tmp_path / "x", {"r": 4}, _ab("q_proj", 4, out_f=16)))
    (module,) = read_lora_adapter(lora)[1]
    module.check(lora, 16, 8, max_rank=None)
    with pytest.raises(RequestError, match=r"'q_proj' has lora_A \(4, 8\) and lora_B \(16, 4\), which do not fit the model's layer \(8 x 8\)"):
        module.check(lora, 8, 8, max_rank=None)
    with pytest.raises(RequestError, match="rank 4 exceeds build.max_lora_rank = 2"):
        module.check(lora, 16, 8, max_rank=2)


def test_a_lora_rank_past_the_default_bound_is_refused(tmp_path: Any) -> None:
    """With no build.max_lora_rank, ranks above DEFAULT_MAX_LORA_RANK (64, docs/lora.md) are refused
    from the header alone, before any weight is read (a rank-200,000 adapter cost +100 MB)."""
    from lmdock._llm.lora import DEFAULT_MAX_LORA_RANK
    from lmdock.backend import read_lora_adapter

    assert DEFAULT_MAX_LORA_RANK == 64
    lora = LoRARequest("x", _peft_folder(tmp_path / "x", {"r": 200_000}, _ab("q_proj", 200_000, out_f=8, in_f=8)))
    (module,) = read_lora_adapter(lora)[1]
    with pytest.raises(RequestError, match=r"rank 200000 exceeds build.max_lora_rank = 64 \(the default\)"):
        module.check(lora, 8, 8, max_rank=None)
    module.check(lora, 8, 8, max_rank=200_000)  # an operator who raises it gets it


def test_rank_pattern_keys_match_as_names_never_as_regexes(tmp_path: Any) -> None:
    """PEFT's keys match a module name's dotted end, ``^KEY`` the whole name; a regex such as
    ``(a+)+X`` (which Python's re would backtrack on for minutes against a long module name) is
    refused at once, naming the field."""
    import time

    from lmdock.backend import read_lora_adapter

    shapes = {**_ab("model.layers.0.self_attn.q_proj", 2), **_ab("model.layers.1.self_attn.q_proj", 4)}
    config = {"r": 4, "rank_pattern": {"^model.layers.0.self_attn.q_proj": 2}, "alpha_pattern": {"layers\\.1\\.self_attn.q_proj": 16}}
    modules = {m.name: m.scale for m in read_lora_adapter(LoRARequest("a", _peft_folder(tmp_path / "a", config, shapes)))[1]}
    assert modules == {"model.layers.0.self_attn.q_proj": 4 / 2, "model.layers.1.self_attn.q_proj": 16 / 4}
    long_name = "a" * 40
    t0 = time.monotonic()
    with pytest.raises(RequestError, match="rank_pattern has a key that is not a module name"):
        read_lora_adapter(LoRARequest("b", _peft_folder(tmp_path / "b", {"r": 4, "rank_pattern": {"(a+)+X": 2}}, _ab(long_name, 4))))
    assert time.monotonic() - t0 < 5  # re.match would take far longer (2**40 paths): this is no timing target


def test_an_adapters_file_content_is_never_in_its_errors(tmp_path: Any) -> None:
    """A folder whose adapter_config.json is a symlink to another file: the error names the setting,
    never what the file holds (a client that loads adapters at run time reads these errors)."""
    import json

    from lmdock.backend import read_lora_adapter

    secret = tmp_path / "secret.json"
    for content in ({"peft_type": "SECRET-TOKEN-1"}, {"r": "SECRET-TOKEN-1"}, {"r": 4, "use_dora": "SECRET-TOKEN-1"},
                    ["SECRET-TOKEN-1"], "SECRET-TOKEN-1 not json"):
        secret.write_text(content if isinstance(content, str) else json.dumps(content))
        folder = _peft_folder(tmp_path / f"f{len(list(tmp_path.iterdir()))}", {"r": 4}, _ab("q_proj", 4))
        (folder / "adapter_config.json").unlink()
        (folder / "adapter_config.json").symlink_to(secret)
        with pytest.raises(RequestError) as err:
            read_lora_adapter(LoRARequest("x", folder))
        assert "SECRET" not in str(err.value) and "adapter_config.json" in str(err.value)
