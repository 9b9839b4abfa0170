"""Fixtures: the planted model, a real ``lmdock serve`` on it (127.0.0.1) behind a recording proxy,
and the CLIs' paths (``LMDOCK_CLAUDE`` / ``LMDOCK_CODEX``: a missing one fails, it does not skip)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests_serve"))

import planted  # noqa: E402
from recorder import Recorder  # noqa: E402
from serve_helpers import Server  # noqa: E402


def cli(var: str) -> Path:
    value = os.environ.get(var)
    if not value or not Path(value).is_file():
        pytest.fail(f"{var}={value!r} is not the path of the CLI; install it (scripts/test.sh, step clis) and set {var}")
    return Path(value)


@pytest.fixture(scope="session")
def claude() -> Path:
    return cli("LMDOCK_CLAUDE")


@pytest.fixture(scope="session")
def codex() -> Path:
    return cli("LMDOCK_CODEX")


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorder]:
    """``lmdock serve`` with the planted model as ``planted``, reached through a proxy that records
    each request body (the server's side of the conversation)."""
    model = planted.cached()
    table = (f'[models.planted]\nmodel = "{model}"\nbackend = "hf"\ntool_parser = "hermes"\n'
             '[models.planted.sampling]\ntemperature = 0.0\n[models.planted.backends.hf]\nnum_threads = 1\n')
    server = Server(tmp_path_factory.mktemp("clis"), args=("--model", "planted"), extra_models=table)
    recorder = Recorder(server.url)
    yield recorder
    recorder.stop()
    server.stop()


@pytest.fixture
def fresh(served: Recorder) -> Recorder:
    served.bodies.clear()
    return served
