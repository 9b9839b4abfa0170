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
from lmdock._plugin.manager import get_registry
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
    result.assert_outcomes(passed=9)  # greedy tokens and text, token ids, test_logprobs.py (5), test_token_bias.py's logprobs (1)


def test_bad_options_are_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "--pyargs", "lmdock_conformance", "--lmdock-backend=template", f"--lmdock-model={stories()}", "--lmdock-options={nope", "-k", "model_loads",
    )
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--lmdock-options is not valid JSON*"])


# -- deliberately wrong backends: each must fail exactly the tests that check what it breaks -------------

WRONG_BACKENDS = '''
import dataclasses
import numpy as np
import lmdock
from lmdock._plugin.loader import _wrap_step_engine
from lmdock._plugin.manager import get_registry
from lmdock_template import SPEC
from lmdock_template._engine import NumpyLlama


class Leaky(NumpyLlama):
    """Deliberately wrong: release() forgets nothing (an abort leaks the sequence)."""

    def release(self, seq_id):
        pass


class OffByALittle(NumpyLlama):
    """Deliberately wrong: logits off by up to 1e-3 (within greedy, outside the logprob tolerance)."""

    def step(self, chunks):
        out = super().step(chunks)
        noise = np.random.default_rng(0).uniform(-1e-3, 1e-3, out.last.shape[1]).astype(np.float32)
        out.last = out.last + noise
        out.full = {k: v + noise for k, v in out.full.items()}
        return out


class WrongRequestEngine:
    """A request engine (it samples for itself, as vLLM does) that drops one parameter."""

    def __init__(self, inner, drop):
        self.inner, self.drop = inner, drop

    def submit(self, request, sink):
        request = dataclasses.replace(request, params=request.params.replace(**self.drop))
        self.inner.submit(request, sink)

    def __getattr__(self, name):
        return getattr(self.inner, name)


DROPS = {
    "ignores-stop": {"stop": ()},
    "ignores-seed": {"seed": None},
    "ignores-beams": {"beam_width": 1},
    "ignores-top-k": {"top_k": 0},
}
STEP = {"leaky": Leaky, "off-by-a-little": OffByALittle}


class WrongPlugin:
    @lmdock.hookimpl
    def lmdock_register_backends(self, register):
        for name in STEP:
            register(dataclasses.replace(SPEC, name=name))
        for name in DROPS:
            register(dataclasses.replace(SPEC, name=name, kind="request"))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend, model_config, options, quantization, build):
        if backend in STEP:
            return STEP[backend].load(model_config)
        if backend in DROPS:
            engine = NumpyLlama.load(model_config)
            runner = _wrap_step_engine(engine, SPEC, model_config, get_registry().hook())
            return WrongRequestEngine(runner, DROPS[backend])
        return None


def pytest_configure(config):
    get_registry().add_plugin(WrongPlugin(), "wrong-backends")
'''

#: backend -> (the tests to run, the ones that must fail)
WRONG = {
    "ignores-stop": ("stop_string", {"test_stop_string_cuts_text", "test_stop_string_spanning_tokens"}),
    "ignores-seed": ("seed", {"test_seed_reproducibility", "test_seeded_samples_do_not_depend_on_the_batch",
                              "test_seeded_sampling_is_reproducible_with_speculation"}),
    "ignores-beams": ("beam_search_matches", {"test_beam_search_matches_transformers"}),
    "ignores-top-k": ("distribution_under", {"test_first_token_distribution_under_sampling_settings[temperature=2.0,top_k=3]"}),
    "leaky": ("abort_frees or preemption_under", {"test_abort_frees_the_backends_state", "test_preemption_under_a_small_kv_budget_gives_the_same_tokens"}),
    "off-by-a-little": ("logprobs_of or prompt_logprobs or greedy_reference_tokens", {"test_logprobs_of_generated_tokens", "test_prompt_logprobs"}),
}


@pytest.mark.parametrize("backend", sorted(WRONG))
def test_each_wrong_backend_fails_exactly_its_tests(pytester: pytest.Pytester, backend: str) -> None:
    selection, must_fail = WRONG[backend]
    pytester.makeconftest(WRONG_BACKENDS)
    result = pytester.runpytest_subprocess(
        "--pyargs", "lmdock_conformance", f"--lmdock-backend={backend}", f"--lmdock-model={stories()}",
        "-k", selection, "-rfEs", "-p", "no:cacheprovider",
    )
    failed = {line.split("::", 1)[1].split(" ", 1)[0] for line in result.stdout.lines if line.startswith("FAILED ")}
    assert failed == must_fail, f"{backend}: expected exactly {sorted(must_fail)} to fail, got {sorted(failed)}\n" + result.stdout.str()[-3000:]


# -- --lmdock-sampler: a backend's native sampler is held to the reference's distribution ---------------

HOT_SAMPLER = '''
import dataclasses
import lmdock
from lmdock._plugin.manager import get_registry
from lmdock.backend import ReferenceSampler
from lmdock_template import SPEC
from lmdock_template._engine import NumpyLlama


class Hot(ReferenceSampler):
    """Deliberately wrong native sampler: draws at twice the temperature asked (greedy unchanged)."""

    def sample(self, logits, rows):
        return super().sample(logits / 2, rows)


class HotPlugin:
    @lmdock.hookimpl
    def lmdock_register_backends(self, register):
        register(dataclasses.replace(SPEC, name="hot"))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend, model_config, options, quantization, build):
        return NumpyLlama.load(model_config) if backend == "hot" else None

    @lmdock.hookimpl
    def lmdock_make_sampler(self, backend, model_config):
        return Hot() if backend == "hot" else None


def pytest_configure(config):
    get_registry().add_plugin(HotPlugin(), "hot")
'''


@pytest.mark.parametrize(("sampler", "fails"), [("backend", True), ("reference", False)])
def test_the_sampler_option_picks_who_samples(pytester: pytest.Pytester, sampler: str, fails: bool) -> None:
    """The backend's own sampler is what the suite tests by default (a wrong one fails the chi-square);
    ``--lmdock-sampler=reference`` replaces it with the core's."""
    pytester.makeconftest(HOT_SAMPLER)
    result = pytester.runpytest_subprocess(
        "--pyargs", "lmdock_conformance", "--lmdock-backend=hot", f"--lmdock-model={stories()}", f"--lmdock-sampler={sampler}",
        "-k", "first_token_distribution", "-p", "no:cacheprovider",
    )
    got = result.parseoutcomes()
    # the first-token chi-squares (test_generation.py's and test_reliability.py's under each setting)
    assert (got.get("failed", 0) > 0, got.get("passed", 0) > 0) == (fails, not fails), got
