"""Plugin loading is lazy and contained; mistakes name the plugin and say what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lmdock
import pytest
from fakes import FakePlugin
from lmdock import LLM, BackendError, PluginError
from lmdock._plugin import manager as _plugins
from lmdock.backend import BackendSpec


def make_dist(root: Path, name: str, module: str, source: str) -> None:
    """An installed distribution with an `lmdock` entry point, as pip would lay it out."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    ep_name = name.removeprefix("lmdock-")
    (info / "entry_points.txt").write_text(f"[lmdock]\n{ep_name} = {module}\n")


GOOD = '''
import lmdock
@lmdock.hookimpl
def lmdock_register_backends(register):
    register(lmdock.backend.BackendSpec(name="good", kind="step", plugin_api="1.0", supports=frozenset({"generate"})))
'''
EXPLODES = "raise RuntimeError('boom: missing libfoo.so')\n"
OLD_API = '''
import lmdock
@lmdock.hookimpl
def lmdock_register_backends(register):
    register(lmdock.backend.BackendSpec(name="oldapi", kind="step", plugin_api="0.3"))
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    make_dist(root, "lmdock-good", "lmdock_good", GOOD)
    make_dist(root, "lmdock-explodes", "lmdock_explodes", EXPLODES)
    make_dist(root, "lmdock-oldapi", "lmdock_oldapi", OLD_API)
    return root


def run(site: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **env}
    full.pop("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", None)
    full.pop("LMDOCK_PLUGINS", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=site)


def backends_json(site: Path, **env: str) -> dict[str, dict]:
    out = run(site, "import lmdock._cli.main as c; c.main(['backends', '--json'])", **env)
    assert out.returncode == 0, out.stderr
    return {row["name"]: row for row in json.loads(out.stdout)}


def test_broken_plugin_is_listed_with_its_error_and_others_work(site: Path) -> None:
    rows = backends_json(site)
    assert rows["explodes"]["status"] == "broken"
    assert "boom: missing libfoo.so" in rows["explodes"]["reason"]
    assert rows["oldapi"]["status"] == "broken"
    assert "plugin API 0.3" in rows["oldapi"]["reason"]
    assert rows["good"]["status"] == "available"
    assert rows["good"]["capabilities"] == ["generate"]


def test_selecting_a_broken_plugin_names_it_and_the_cause(site: Path) -> None:
    out = run(site, "import lmdock; lmdock.LLM('m', backend='explodes')")
    assert out.returncode != 0
    assert "PluginError" in out.stderr
    assert "plugin 'explodes' (from lmdock-explodes) failed to load: RuntimeError: boom: missing libfoo.so" in out.stderr


def test_cli_reports_a_broken_plugin_in_one_line(site: Path) -> None:
    out = run(site, "import sys, lmdock._cli.main as c; sys.exit(c.main(['generate', '-m', 'x', '--backend', 'explodes', 'hi']))")
    assert out.returncode == 2
    assert out.stderr.startswith("lmdock: error: backend 'explodes': plugin 'explodes'")
    assert "Traceback" not in out.stderr


def test_autoload_can_be_disabled_or_narrowed(site: Path) -> None:
    assert "good" not in backends_json(site, LMDOCK_DISABLE_PLUGIN_AUTOLOAD="1")
    narrowed = backends_json(site, LMDOCK_PLUGINS="good")
    assert "good" in narrowed and "explodes" not in narrowed and "oldapi" not in narrowed


def test_unknown_backend_lists_installed_ones_and_the_package(fake: FakePlugin) -> None:
    with pytest.raises(BackendError) as info:
        LLM("some-model", backend="onnx")
    msg = str(info.value)
    assert "unknown backend 'onnx'" in msg
    assert "fake" in msg
    assert "pip install lmdock-onnx" in msg


def test_incompatible_plugin_api_is_refused(isolated: Path) -> None:
    class Future:
        @lmdock.hookimpl
        def lmdock_register_backends(self, register):  # type: ignore[no-untyped-def]
            register(BackendSpec(name="future", kind="step", plugin_api="2.0"))

    reg = _plugins.get_registry()
    reg.add_plugin(Future(), "future")
    assert "future" not in reg.backends
    with pytest.raises(PluginError, match=r"plugin API 2.0, but this lmdock implements 1.0"):
        reg.backend("future")


def test_hookimpl_with_a_wrong_argument_is_reported_not_raised(isolated: Path) -> None:
    class Typo:
        @lmdock.hookimpl
        def lmdock_register_backends(self, registr):  # type: ignore[no-untyped-def]
            pass

    reg = _plugins.get_registry()
    reg.add_plugin(Typo(), "typo")
    assert "registr" in reg.broken["typo"].error


def test_fallback_is_tried_when_the_first_backend_is_missing(fake: FakePlugin) -> None:
    with LLM("some-model", backend="onnx", fallback=["fake"]) as llm:
        assert llm.backend.name == "fake"


def test_auto_picks_an_available_backend(fake: FakePlugin) -> None:
    with LLM("some-model", backend="auto") as llm:
        assert llm.backend.name == "fake"
