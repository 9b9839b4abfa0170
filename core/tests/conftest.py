from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakePlugin  # noqa: E402
from lmdock._plugin import manager as _plugins  # noqa: E402


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty folder with no config file, no user config and no autoloaded plugins."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LMDOCK_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", "1")
    _plugins.reset_registry()
    yield tmp_path
    _plugins.reset_registry()


@pytest.fixture
def fake(isolated: Path) -> Iterator[FakePlugin]:
    """The FAKE backend registered in a fresh registry."""
    plugin = FakePlugin()
    _plugins.get_registry().add_plugin(plugin, "fake")
    yield plugin


@pytest.fixture(params=["inline", "overlap"])
def host_overlap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: the FAKE engine without, then with ``overlap_host_work`` (the loop's output
    work deferred to its helper thread during the next step; ``lmdock._engine.overlap``)."""
    from fakes import FakeStepEngine

    monkeypatch.setattr(FakeStepEngine, "overlap_host_work", request.param == "overlap", raising=False)
    return str(request.param)
