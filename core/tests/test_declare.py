"""lmdock.backend.Backend: a plugin declared once, answering for its own backend only (FAKE engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fakes import FakeStepEngine
from lmdock import LLM, SamplingParams, UnsupportedError
from lmdock._plugin import manager as _plugins
from lmdock.backend import Backend, BackendSpec, has_nvidia_gpu

REPO = Path(__file__).resolve().parents[2]


def _spec(name: str, **kw: Any) -> BackendSpec:
    return BackendSpec(name=name, kind="step", plugin_api="1.0", supports=frozenset({"generate"}), description="FAKE test backend", **kw)


class Calls:
    def __init__(self) -> None:
        self.load: list[str] = []
        self.build: list[str] = []
        self.quantize: list[str] = []

    def backend(self, name: str, **kw: Any) -> Backend:
        def load(mc: Any, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
            self.load.append(name)
            assert build == {"from": name} and quantization in (None, f"q-{name}")
            return FakeStepEngine()

        def build_(mc: Any) -> dict[str, Any]:
            self.build.append(name)
            return {"from": name}

        def quantize(quant: Any, mc: Any) -> str:
            self.quantize.append(name)
            return f"q-{name}"

        return Backend(kw.pop("spec", None) or _spec(name), load=load, build=build_, quantize=quantize, **kw)


def test_each_backend_answers_only_for_its_own_name(isolated: Path) -> None:
    calls = Calls()
    reg = _plugins.get_registry()
    reg.add_plugin(calls.backend("one"), "one")
    reg.add_plugin(calls.backend("two"), "two")
    assert {"one", "two"} <= set(reg.backends)
    with LLM("fake-model", backend="two", quantization={"algo": "int8_weight_only"}) as llm:
        assert llm.generate([[1, 2]], SamplingParams(max_new_tokens=2, temperature=0))[0].outputs[0].token_ids
    assert calls.load == calls.build == calls.quantize == ["two"]


def test_without_quantize_every_quantization_is_refused(isolated: Path) -> None:
    _plugins.get_registry().add_plugin(Backend(_spec("plain"), load=lambda *a: FakeStepEngine()), "plain")
    with pytest.raises(UnsupportedError, match="cannot quantize"):
        LLM("m", backend="plain", quantization={"algo": "int8_weight_only"})
    with LLM("m", backend="plain") as llm:  # and without [quantization] it loads
        assert llm.generate([[1]], SamplingParams(max_new_tokens=1))[0].outputs[0].token_ids


@pytest.mark.parametrize("build", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_parallelism_is_refused_unless_declared(isolated: Path, build: dict[str, int]) -> None:
    calls = Calls()
    reg = _plugins.get_registry()
    reg.add_plugin(calls.backend("single"), "single")
    reg.add_plugin(calls.backend("multi", parallel=True), "multi")
    with pytest.raises(UnsupportedError, match="one device.*lmdock-vllm"):
        LLM("m", backend="single", build=build)
    assert calls.load == []
    LLM("m", backend="multi", build=build).shutdown()
    assert calls.load == ["multi"]


def test_offload_is_refused_with_the_specs_own_reason(isolated: Path) -> None:
    calls = Calls()
    spec = _spec("nooff", lacks={"offload": "weights live in a FAKE arena"})
    _plugins.get_registry().add_plugin(calls.backend("nooff", spec=spec), "nooff")
    with pytest.raises(UnsupportedError, match=r"does not offload weights \(weights live in a FAKE arena\); remove \[offload\]"):
        LLM("m", backend="nooff", offload={"weights_cpu_percent": 50, "weights_gpu_percent": 0})
    assert calls.load == []


def test_a_backend_that_supports_offload_gets_the_policy(isolated: Path) -> None:
    seen: list[bool] = []

    def load(mc: Any, *_: Any) -> Any:
        seen.append(mc.offload.enabled)
        return FakeStepEngine()

    spec = BackendSpec(name="off", kind="step", plugin_api="1.0", supports=frozenset({"generate", "offload"}))
    _plugins.get_registry().add_plugin(Backend(spec, load=load), "off")
    LLM("m", backend="off", offload={"weights_cpu_percent": 50, "weights_gpu_percent": 0}).shutdown()
    assert seen == [True]


def test_has_nvidia_gpu_reads_only_the_device_node_and_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import shutil

    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert has_nvidia_gpu()
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not has_nvidia_gpu()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    assert has_nvidia_gpu()


def test_no_first_party_plugin_checks_its_own_backend_name() -> None:
    """The registration is written once (Backend): an entry module that guards a hook with its own
    name (``if backend != "hf": return None``) has gone back to copying it."""
    import re

    guard = re.compile(r"if\s+backend\s*!=\s*['\"]")
    offenders = [
        str(p.relative_to(REPO))
        for root in ("plugins", "contrib")
        for p in (REPO / root).glob("*/src/*/*.py")
        if guard.search(p.read_text())
    ]
    assert offenders == [], f"use lmdock.backend.Backend instead of name guards in {offenders}"
