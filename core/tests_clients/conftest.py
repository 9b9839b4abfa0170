"""Fixtures: a real ``lmdock serve`` subprocess on 127.0.0.1 (core/tests_serve/serve_helpers.py), for
clients that need their own environment (instructor pins an older openai; see scripts/test.sh)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests_serve"))

from serve_helpers import Server  # noqa: E402


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "template.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    s = Server(tmp, args=("--chat-template", str(template)))
    yield s
    s.stop()
