"""The plugin is installed, discoverable, light to import, and its engine loads."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from typing import Any

HEAVY = ("torch", "numpy", "transformers", "vllm", "mlx", "onnxruntime", "tensorrt_llm", "tensorflow", "jax")


def test_backend_is_registered_through_an_entry_point(lmdock_setup: Any) -> None:
    spec = lmdock_setup.spec
    names = {ep.name for ep in importlib.metadata.entry_points(group="lmdock")}
    assert spec.plugin in names, f"plugin {spec.plugin!r} is not an entry point of the 'lmdock' group"
    assert spec.kind in ("step", "request")


def test_every_capability_is_declared_with_a_reason_when_lacking(lmdock_setup: Any) -> None:
    from lmdock.backend import CAPABILITIES

    spec = lmdock_setup.spec
    unknown = set(spec.supports) - set(CAPABILITIES)
    assert not unknown, f"unknown capabilities declared: {unknown}"
    for cap in CAPABILITIES:
        ok, reason = spec.capability(cap)
        assert ok or (cap in spec.lacks and reason.strip()), f"{cap!r} is neither supported nor lacked with a reason"


def test_entry_module_imports_no_engine(lmdock_setup: Any) -> None:
    ep = next(ep for ep in importlib.metadata.entry_points(group="lmdock") if ep.name == lmdock_setup.spec.plugin)
    code = f"import sys, json, {ep.module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], "the entry-point module imports heavy packages"


def test_availability_probe_says_available(lmdock_setup: Any) -> None:
    assert lmdock_setup.spec.available() is None


def test_model_loads(llm: Any) -> None:
    assert llm.max_model_len > 0
    assert llm.tokenizer is not None
