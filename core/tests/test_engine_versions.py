"""`lmdock backends` shows each backend's engine packages against the range its plugin declares, and
warns (never refuses) when one is outside it; so does loading a model (issue 26)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdock
import pytest
from fakes import FakeStepEngine
from lmdock import LLM
from lmdock._cli.main import main
from lmdock._plugin import manager as _plugins
from lmdock._plugin import versions as _versions
from lmdock.backend import BackendSpec

#: lmdock-eng's Requires-Dist lines as a wheel writes them (specifiers sorted, markers normalized).
REQUIRES = [
    "lmdock<0.2,>=0.1",
    "eng-core<5.25,>=4.56",
    "numpy>=1.24",
    'eng-gpu<0.34,>=0.11; extra == "gpu"',
    'eng-cpu<0.33,>=0.32; extra == "cpu"',
    'eng-core<5.20; extra == "cpu"',
    "eng-mac>=0.30; sys_platform == 'never-a-platform'",
]


class EnginePlugin:
    """Registers backend "eng" from distribution lmdock-eng, whose engine is eng-core (+ a GPU or CPU build)."""

    def __init__(self, engine_packages: tuple[str, ...] = ("eng-core", "eng-gpu", "eng-cpu")) -> None:
        self.engine_packages = engine_packages

    @lmdock.hookimpl
    def lmdock_register_backends(self, register: Any) -> None:
        register(BackendSpec(name="eng", kind="step", plugin_api="1.0", supports=frozenset({"generate"}),
                             package="lmdock-eng", version="1.0", engine_packages=self.engine_packages))

    @lmdock.hookimpl
    def lmdock_load_engine(self, backend: str, model_config: Any, options: Any, quantization: Any, build: Any) -> Any:
        return FakeStepEngine() if backend == "eng" else None


def fake_metadata(monkeypatch: pytest.MonkeyPatch, installed: dict[str, str], requires: list[str] = REQUIRES) -> None:
    monkeypatch.setattr(_versions, "installed_version", installed.get)
    monkeypatch.setattr(_versions, "requirements", lambda dist: requires if dist == "lmdock-eng" else [])
    monkeypatch.setattr(_versions, "_checked", set())


@pytest.fixture
def eng(isolated: Path) -> Iterator[BackendSpec]:
    _plugins.get_registry().add_plugin(EnginePlugin(), "eng", "lmdock-eng")
    yield _plugins.get_registry().backend("eng")


def by_name(spec: BackendSpec) -> dict[str, _versions.EnginePackage]:
    return {p.name: p for p in _versions.engine_packages(spec)}


# -- ranges and comparisons ------------------------------------------------------------------------


def test_ranges_come_from_requires_dist_with_extras_and_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_metadata(monkeypatch, {})
    ranges = _versions.declared_ranges("lmdock-eng")
    assert ranges["eng-gpu"] == ">=0.11,<0.34"  # lower bound first, as people write it
    assert ranges["eng-cpu"] == ">=0.32,<0.33"
    assert ranges["eng-core"] == ">=4.56,<5.25"  # the cpu extra's own "<5.20" binds only users of that extra
    assert "eng-mac" not in ranges  # its marker holds on no platform here
    assert ranges["numpy"] == ">=1.24"


def test_names_match_as_pip_normalizes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_metadata(monkeypatch, {"Llama_CPP.python": "0.3.40"}, ["llama-cpp-python<0.4,>=0.3.36", "not a requirement !!"])
    spec = BackendSpec(name="x", kind="step", plugin_api="1.0", package="lmdock-eng", engine_packages=("Llama_CPP.python",))
    (pkg,) = _versions.engine_packages(spec)
    assert (pkg.declared, pkg.in_range) == (">=0.3.36,<0.4", True)


@pytest.mark.parametrize(("version", "in_range"), [
    ("4.56", True), ("5.24.3", True), ("4.55.9", False),
    ("5.25.0", False),
    ("5.25.0rc1", False),    # PEP 440: "<5.25" excludes 5.25's own pre-releases
    ("5.24.0rc1", True),     # an installed pre-release inside the range counts (as `pip check` counts it)
    ("5.24.0+cu128", True),  # a local build counts as its release
    ("not-pep-440", None),   # cannot be compared: no claim either way
])
def test_versions_compare_as_pip_compares_them(monkeypatch: pytest.MonkeyPatch, version: str, in_range: bool | None) -> None:
    from packaging.specifiers import SpecifierSet

    fake_metadata(monkeypatch, {"eng-core": version})
    spec = BackendSpec(name="eng", kind="step", plugin_api="1.0", package="lmdock-eng", engine_packages=("eng-core",))
    (pkg,) = _versions.engine_packages(spec)
    assert pkg.in_range is in_range
    if in_range is not None:  # the very check `pip check` makes of an installed distribution
        assert SpecifierSet(pkg.declared or "").contains(version, prereleases=True) is in_range


def test_not_installed_and_undeclared_packages_make_no_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_metadata(monkeypatch, {"eng-core": "5.0", "undeclared": "1.0"})
    spec = BackendSpec(name="eng", kind="step", plugin_api="1.0", package="lmdock-eng", engine_packages=("eng-gpu", "undeclared"))
    gpu, undeclared = _versions.engine_packages(spec)
    assert (gpu.version, gpu.declared, gpu.in_range) == (None, ">=0.11,<0.34", None)
    assert (undeclared.version, undeclared.declared, undeclared.in_range) == ("1.0", None, None)
    assert gpu.describe() == "eng-gpu not installed"
    assert undeclared.describe() == "undeclared 1.0 (no tested range declared)"
    assert _versions.warnings_for(spec) == []


def test_a_spec_without_engine_packages_reads_no_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(dist: str) -> list[str]:
        raise AssertionError("read")

    monkeypatch.setattr(_versions, "requirements", boom)
    assert _versions.engine_packages(BackendSpec(name="t", kind="step", plugin_api="1.0", package="lmdock-t")) == []


def test_the_warning_says_what_to_install_and_when_to_upgrade_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = BackendSpec(name="eng", kind="step", plugin_api="1.0", package="lmdock-eng", engine_packages=("eng-gpu",))
    fake_metadata(monkeypatch, {"eng-gpu": "0.34.1"})
    assert _versions.warnings_for(spec) == [
        'eng: eng-gpu 0.34.1 is outside the range lmdock-eng was tested with (>=0.11,<0.34); '
        'pip install "eng-gpu>=0.11,<0.34" or upgrade lmdock-eng'
    ]
    fake_metadata(monkeypatch, {"eng-gpu": "0.10"})  # too old: only installing a tested release helps
    assert _versions.warnings_for(spec)[0].endswith('pip install "eng-gpu>=0.11,<0.34"')


def test_a_failed_check_is_a_warning_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(dist: str) -> list[str]:
        raise OSError("unreadable METADATA")

    monkeypatch.setattr(_versions, "requirements", broken)
    spec = BackendSpec(name="eng", kind="step", plugin_api="1.0", package="lmdock-eng", engine_packages=("eng-core",))
    assert _versions.report(spec) == ([], ["eng: engine versions not checked: OSError: unreadable METADATA"])


# -- lmdock backends --------------------------------------------------------------------------------


def test_backends_lists_engine_packages_and_warns_out_of_range(eng: BackendSpec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_metadata(monkeypatch, {"eng-core": "5.26.0", "eng-cpu": "0.32.1"})
    assert main(["backends"]) == 0  # a warning, not a refusal
    out, err = capsys.readouterr()
    assert "           engine: eng-core 5.26.0 (outside the tested range >=4.56,<5.25)\n" in out
    assert "           engine: eng-cpu 0.32.1 (tested >=0.32,<0.33)\n" in out
    assert "eng-gpu" not in out  # not installed: the JSON says so, the listing does not
    assert err.splitlines() == [
        'lmdock: warning: eng: eng-core 5.26.0 is outside the range lmdock-eng was tested with (>=4.56,<5.25); '
        'pip install "eng-core>=4.56,<5.25" or upgrade lmdock-eng'
    ]


def test_backends_json_has_each_engine_package(eng: BackendSpec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_metadata(monkeypatch, {"eng-core": "5.22.0", "eng-gpu": "0.40.0"})
    assert main(["backends", "--json"]) == 0
    out, err = capsys.readouterr()
    (row,) = [r for r in json.loads(out) if r["name"] == "eng"]
    assert row["engine_packages"] == [
        {"name": "eng-core", "version": "5.22.0", "declared": ">=4.56,<5.25", "in_range": True},
        {"name": "eng-gpu", "version": "0.40.0", "declared": ">=0.11,<0.34", "in_range": False},
        {"name": "eng-cpu", "version": None, "declared": ">=0.32,<0.33", "in_range": None},
    ]
    assert row["warnings"] == [err.splitlines()[0].removeprefix("lmdock: warning: ")]
    assert "eng-gpu 0.40.0 is outside" in row["warnings"][0]


def test_backends_in_range_prints_no_warning(eng: BackendSpec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_metadata(monkeypatch, {"eng-core": "5.0.0"})
    assert main(["backends"]) == 0
    out, err = capsys.readouterr()
    assert "engine: eng-core 5.0.0 (tested >=4.56,<5.25)" in out
    assert err == ""


# -- loading a model --------------------------------------------------------------------------------


def test_loading_warns_once_per_process_and_still_loads(eng: BackendSpec, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fake_metadata(monkeypatch, {"eng-core": "5.26.0"})
    with caplog.at_level(logging.WARNING, logger="lmdock"):
        for _ in range(2):
            with LLM("m", backend="eng") as llm:
                assert llm.generate(["ab"], lmdock.SamplingParams(max_new_tokens=2, temperature=0))[0].outputs[0].token_ids
    warned = [r.getMessage() for r in caplog.records if "outside the range" in r.getMessage()]
    assert warned == ['eng: eng-core 5.26.0 is outside the range lmdock-eng was tested with (>=4.56,<5.25); '
                      'pip install "eng-core>=4.56,<5.25" or upgrade lmdock-eng']


# -- real metadata, end to end ----------------------------------------------------------------------


def _dist(root: Path, name: str, version: str, lines: list[str] = (), module: str | None = None) -> None:  # type: ignore[assignment]
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"{line}\n" for line in lines))
    if module:
        (info / "entry_points.txt").write_text(f"[lmdock]\n{name.removeprefix('lmdock-')} = {module}\n")


PLUGIN = '''
import lmdock
@lmdock.hookimpl
def lmdock_register_backends(register):
    register(lmdock.backend.BackendSpec(name="eng", kind="step", plugin_api="1.0", engine_packages=("eng-core", "eng-gpu")))
'''


def test_installed_distributions_end_to_end(tmp_path: Path) -> None:
    """Real dist-info folders, read by importlib.metadata and packaging in a fresh process."""
    (tmp_path / "lmdock_eng.py").write_text(PLUGIN)
    _dist(tmp_path, "lmdock-eng", "1.0", ["Requires-Dist: eng-core<5.25,>=4.56", "Provides-Extra: gpu",
                                           'Requires-Dist: eng-gpu<0.34,>=0.11; extra == "gpu"'], module="lmdock_eng")
    _dist(tmp_path, "eng-core", "5.26.0")
    _dist(tmp_path, "eng-gpu", "0.33.2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "LMDOCK_PLUGINS": "eng"}
    env.pop("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-m", "lmdock", "backends", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (row,) = [r for r in json.loads(out.stdout) if r["name"] == "eng"]
    assert [(p["name"], p["version"], p["in_range"]) for p in row["engine_packages"]] == [("eng-core", "5.26.0", False), ("eng-gpu", "0.33.2", True)]
    assert 'lmdock: warning: eng: eng-core 5.26.0 is outside the range lmdock-eng was tested with (>=4.56,<5.25)' in out.stderr
