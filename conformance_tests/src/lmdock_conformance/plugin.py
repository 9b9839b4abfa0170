"""The pytest plugin: options, the capability marker, and the session fixtures.

Installed through the ``pytest11`` entry point, so it is active in every pytest run of the
environment; it touches only the tests of this package, and those skip until ``--lmdock-backend``
names a backend.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PACKAGE_DIR = Path(__file__).parent
DEFAULT_LOGPROB_TOLERANCE = 1e-4


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lmdock", "lmdock backend conformance")
    group.addoption("--lmdock-backend", help="the backend to test (its name in `lmdock backends`)")
    group.addoption("--lmdock-model", help="the model to test with: stories260K (a folder) for the reference checks")
    group.addoption("--lmdock-embed-model", default=os.environ.get("LMDOCK_EMBED_MODEL"),
                    help="all-MiniLM-L6-v2 (a folder) for the embed/score tests; default $LMDOCK_EMBED_MODEL")
    group.addoption("--lmdock-options", default="{}", help="JSON: options for LLM(...), e.g. '{\"build\": {\"dtype\": \"float32\"}}'")
    group.addoption("--lmdock-zoo", default=None, help="a built model-family zoo (python -m lmdock_conformance.zoo build DIR): runs test_families")
    group.addoption("--lmdock-zoo-families", default=None, help="comma-separated: only these zoo families (default: every one built)")
    group.addoption("--lmdock-zoo-probe", action="store_true",
                    help="load every family even where the spec refuses it, to find which the engine runs exactly (for writing the declarations)")
    group.addoption("--lmdock-zoo-gguf", default=None,
                    help="the zoo's GGUF conversions for a backend that loads GGUF files: DIR/<family>.gguf, and DIR/gguf.json naming "
                         "the families not converted, with the reason (contrib/llamacpp/tools/zoo_gguf.py writes both)")
    group.addoption("--lmdock-zoo-outcomes", default=None, help="write each family's outcome (exact / refused / diverged) to this JSON file")
    group.addoption("--lmdock-speculative", default=None,
                    help="JSON: run the suite with speculative decoding on (LLM(speculative_config=...)), e.g. "
                         "'{\"method\": \"ngram\"}', or '{\"method\": \"draft\", \"model\": \"@target\"}' "
                         "(the target as its own draft: every draft accepted); results must equal speculation off")
    group.addoption("--lmdock-sampler", choices=("backend", "reference"), default="backend",
                    help="who samples: the backend's choice (its native sampler, where it has one; default), or the core's "
                         "reference sampler forced (run the sampling tests both ways: the reference defines the semantics)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(capability): the test needs this backend capability (lmdock.backend.CAPABILITIES)")
    if config.getoption("--lmdock-backend"):
        _options(config)  # a mistake in the options stops the run before any test


def _json_object(raw: str, flag: str, what: str) -> dict[str, Any]:
    """A JSON object given on the command line, or the usage error naming ``flag``."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise pytest.UsageError(f"{flag} must be a JSON object ({what}), not {raw!r}")
    return value


def _options(config: pytest.Config) -> dict[str, Any]:
    options = _json_object(config.getoption("--lmdock-options") or "{}", "--lmdock-options", "of LLM(...) options")
    spec = config.getoption("--lmdock-speculative", default=None)
    if spec:
        value = _json_object(spec, "--lmdock-speculative", "a speculative_config")
        if value.get("model") == "@target":
            value["model"] = config.getoption("--lmdock-model")
        # every step's rows speculate, however many: the suite's batches run the verify paths too
        options["speculative"] = {"disable_by_batch_size": None, **value}
    return options


def _ours(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).resolve().is_relative_to(PACKAGE_DIR.resolve())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--lmdock-backend"):
        return
    skip = pytest.mark.skip(reason="lmdock-conformance runs for a named backend: pass --lmdock-backend=NAME --lmdock-model=PATH")
    for item in items:
        if _ours(item):
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _ours(item) or not item.config.getoption("--lmdock-backend"):
        return
    spec = _spec(item.config)
    reason = spec.available()
    if reason:
        # Only missing hardware skips; a missing package (or anything else) is a failure.
        if spec.needs_hardware and spec.has_hardware is not None and not spec.has_hardware():
            pytest.skip(f"backend {spec.name!r} needs {spec.needs_hardware}, which this machine lacks: {reason}")
        pytest.fail(f"backend {spec.name!r} is not available here: {reason}", pytrace=False)
    for mark in item.iter_markers("requires"):
        for capability in mark.args:
            ok, reason = spec.capability(capability)
            if not ok:
                pytest.skip(f"backend {spec.name!r} lacks capability {capability!r}: {reason}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """test_families runs once per zoo family (module-scoped: each family's model loads once)."""
    if "zoo_family" not in metafunc.fixturenames:
        return
    from lmdock_conformance.families import zoo_families

    names = zoo_families(metafunc.config)
    metafunc.parametrize("zoo_family", names or ["no-zoo"], indirect=True, scope="module")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    from lmdock_conformance.families import OUTCOMES

    OUTCOMES.note(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--lmdock-zoo-outcomes", default=None)
    if target and session.config.getoption("--lmdock-backend"):
        from lmdock_conformance.families import OUTCOMES

        OUTCOMES.write(target, _spec(session.config))


def _spec(config: pytest.Config) -> Any:
    from lmdock._plugin.manager import get_registry

    return get_registry().backend(config.getoption("--lmdock-backend"))


# -------------------------------------------------------------------------------------------------
# fixtures
# -------------------------------------------------------------------------------------------------


class Setup:
    """What a conformance test knows about the run: backend, spec, model, options, tolerance."""

    def __init__(self, config: pytest.Config) -> None:
        self.backend: str = config.getoption("--lmdock-backend")
        self.model: str | None = config.getoption("--lmdock-model")
        self.options = _options(config)
        self.spec = _spec(config)
        self.tolerance = float(self.spec.tolerances.get("logprobs", DEFAULT_LOGPROB_TOLERANCE))

    def llm(self, **extra: Any) -> Any:
        from lmdock import LLM

        if not self.model:
            raise pytest.UsageError("pass --lmdock-model=PATH (stories260K for the reference checks)")
        options = {**self.options, **extra}
        return LLM(self.model, backend=self.backend, **options)


def reference_sampler_first() -> Any:
    """``--lmdock-sampler=reference``: a plugin answering ``lmdock_make_sampler`` before any backend."""
    from lmdock.backend import ReferenceSampler, hookimpl

    class ReferenceSamplerFirst:
        @hookimpl(tryfirst=True)
        def lmdock_make_sampler(self, backend: str, model_config: Any) -> Any:
            return ReferenceSampler()

    return ReferenceSamplerFirst()


@pytest.fixture(scope="session")
def lmdock_setup(pytestconfig: pytest.Config) -> Setup:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if pytestconfig.getoption("--lmdock-sampler") == "reference":
        from lmdock._plugin.manager import get_registry

        get_registry().add_plugin(reference_sampler_first(), "lmdock-conformance-reference-sampler")
    return Setup(pytestconfig)


@pytest.fixture(scope="session")
def llm(lmdock_setup: Setup) -> Iterator[Any]:
    engine = lmdock_setup.llm()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def reference(lmdock_setup: Setup) -> dict[str, Any]:
    """The recorded facts for stories260K (greedy tokens from ../shared/models/README.md, and
    transformers float32 logprobs); tests that need them skip for other models."""
    model = Path(lmdock_setup.model or "")
    if _is_stories_gguf(model):
        return json.loads((PACKAGE_DIR / "data" / "stories260K.json").read_text())
    cfg_path = model / "config.json"
    if not cfg_path.is_file():
        pytest.skip(f"no recorded reference for {lmdock_setup.model!r}: the reference checks need the stories260K folder")
    cfg = json.loads(cfg_path.read_text())
    if (cfg.get("vocab_size"), cfg.get("hidden_size"), cfg.get("num_hidden_layers")) != (512, 64, 5):
        pytest.skip(f"no recorded reference for {lmdock_setup.model!r}: the reference checks need stories260K")
    return json.loads((PACKAGE_DIR / "data" / "stories260K.json").read_text())


#: SHA-256 of the GGUF conversions of stories260K in ../shared/models/stories260K-gguf (same weights
#: and vocabulary as the folder the reference was recorded on): a GGUF holds no config.json.
STORIES_GGUF_SHA256 = {
    "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d",  # stories260K.gguf
    "d46ebfdf179589528870956047ff14ac9e574a5274e25108ea1a4e6b869c3d2d",  # stories260K.transformers-fixed.gguf
}


def _is_stories_gguf(model: Path) -> bool:
    import hashlib

    files = [model] if model.is_file() else sorted(model.glob("*.gguf")) if model.is_dir() else []
    if len(files) != 1 or files[0].suffix != ".gguf" or files[0].stat().st_size > 16 << 20:
        return False
    return hashlib.sha256(files[0].read_bytes()).hexdigest() in STORIES_GGUF_SHA256
