"""A FAKE step engine behind the in-process app (core plumbing only: ``core/tests/fakes.py``), for the
server suites that check what a clumsy or hostile client must not get past."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lmdock import LLM
from lmdock._plugin import manager as _plugins
from lmdock.backend import Backend, BackendSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes import FakeStepEngine  # noqa: E402


class Failing(FakeStepEngine):
    """Every step raises: after three in a row the runner declares the engine dead."""

    def step(self, chunks: Any) -> Any:
        raise RuntimeError("FAKE device lost")


def fake_llm(engine: type[FakeStepEngine]) -> LLM:
    spec = BackendSpec(name="fake", kind="step", plugin_api="1.0", supports=frozenset({"generate"}), description="FAKE test backend")
    _plugins.get_registry().add_plugin(Backend(spec, load=lambda *a: engine()), "fake")
    return LLM("m", backend="fake")
