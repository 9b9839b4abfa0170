"""Fixtures: real ``lmdock serve`` subprocesses on 127.0.0.1 (see serve_helpers.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lmdock._plugin import manager as _plugins  # noqa: E402
from serve_helpers import Server  # noqa: E402


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "template.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    s = Server(tmp, args=("--chat-template", str(template)))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an API key (from a file), one request in flight at most and a 4 KiB body limit."""
    tmp = tmp_path_factory.mktemp("strict")
    (tmp / "key").write_text("sekret-key\n", encoding="utf-8")
    env: dict[str, str | None] = {"LMDOCK_API_KEY": None}  # the key comes from the file alone
    s = Server(tmp, f'api_key_file = "{tmp / "key"}"\nmax_queue = 1\nmax_body_bytes = 4096\n', env=env)
    yield s
    s.stop()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A fresh registry with no autoloaded plugins, in a folder with no config file (the FAKE-engine suites:
    test_health_and_auth, test_request_bounds, test_serve_command)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LMDOCK_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", "1")
    _plugins.reset_registry()
    yield
    _plugins.reset_registry()
