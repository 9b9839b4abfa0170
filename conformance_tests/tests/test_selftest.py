"""The suite tests itself: it skips without a backend, fails a deliberately wrong backend, passes the
reference engine, and names the capability and the backend's reason in every skip.

Needs lmdock-template installed (the reference engine) and stories260K: ``LMDOCK_MODELS`` names the
folder that holds it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODELS = os.environ.get("LMDOCK_MODELS")

WRONG_BACKEND = '''
import dataclasses
import numpy as np
import lmdock
from lmdock._plugins import get_registry
from lmdock_template import SPEC
from lmdock_template._engine import NumpyLlama


class Shifted(NumpyLlama):
    """Deliberately wrong: every logit belongs to the next token id."""

    def step(self, chunks):
        out = super().step(chunks)
        out.last = np.roll(out.last, 1, axis=1)
        out.full = {k: np.roll(v, 1, axis=1) for k, v in out.full.items()}
        return out


class WrongPlugin:
    @lmdock.hookimpl
    def lmdock_register_backends(self, register):
        register(dataclasses.replace(
            SPEC, name="wrong", supports=SPEC.supports - {"beam_search"},
            lacks={**SPEC.lacks, "beam_search": "beams are left out on purpose"}))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend, model_config, options, quantization, build):
        return Shifted.load(model_config) if backend == "wrong" else None


def pytest_configure(config):
    get_registry().add_plugin(WrongPlugin(), "wrong")
'''


def stories() -> str:
    if not MODELS or not (Path(MODELS) / "stories260K" / "config.json").is_file():
        pytest.fail("set LMDOCK_MODELS to the folder that holds stories260K")
    return str(Path(MODELS) / "stories260K")


def test_does_nothing_without_a_backend(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "lmdock_conformance", "-rs")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) == 0 and outcomes.get("failed", 0) == 0 and outcomes["skipped"] >= 25
    result.stdout.fnmatch_lines(["*runs for a named backend: pass --lmdock-backend=NAME*"])


def test_a_wrong_backend_fails_and_skips_name_the_reason(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(WRONG_BACKEND)
    result = pytester.runpytest_subprocess(
        "--pyargs", "lmdock_conformance", "--lmdock-backend=wrong", f"--lmdock-model={stories()}", "-rfs", "-p", "no:cacheprovider",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 5
    result.stdout.fnmatch_lines([
        "*FAILED*test_generation.py::test_greedy_reference_tokens*",
    ])
    for name in ("test_greedy_reference_text", "test_token_id_prompt_equals_text_prompt", "test_logprobs_of_generated_tokens", "test_next_token_logprobs"):
        result.stdout.fnmatch_lines([f"*FAILED*{name}*"])
    result.stdout.fnmatch_lines(["*backend 'wrong' lacks capability 'beam_search': beams are left out on purpose*"])


def test_the_reference_engine_passes_what_the_wrong_one_fails(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "--pyargs", "lmdock_conformance", "--lmdock-backend=template", f"--lmdock-model={stories()}",
        "-k", "greedy_reference or token_id_prompt or logprobs", "-p", "no:cacheprovider",
    )
    result.assert_outcomes(passed=7)  # greedy tokens and text, token ids, test_logprobs.py (4)


def test_bad_options_are_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "--pyargs", "lmdock_conformance", "--lmdock-backend=template", f"--lmdock-model={stories()}", "--lmdock-options={nope", "-k", "model_loads",
    )
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--lmdock-options is not valid JSON*"])
