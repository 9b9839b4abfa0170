"""Speculative decoding's engine side on lmdock-onnx (issue 42): verify rows mixed with decode rows,
and ``truncate``, on each of the ways the engine passes the past to a graph: lmdock's own export
(the whole capacity, masked), a sliding-window model (each row's past copied right-aligned), and
onnxruntime-genai's GroupQueryAttention graph (past and present one buffer, written in place).
The checks are lmdock-conformance's: every logit after a truncate equals a fresh sequence's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lmdock_conformance.truncate import check_truncate, load_step_engine

sys.path.insert(0, str(Path(__file__).parent))
import _tiny  # noqa: E402

MODELS = Path(os.environ.get("LMDOCK_MODELS", ""))


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMDOCK_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "lmdock-cache"))


def _check(folder: Path) -> object:
    engine = load_step_engine("onnx", str(folder))
    try:
        assert check_truncate(engine) is None
    finally:
        engine.close()
    return engine


def test_truncate_on_lmdocks_export() -> None:
    engine = _check(MODELS / "stories260K")
    assert not engine.contiguous_past and engine.layout.present == "new"


def test_truncate_with_a_sliding_window(tmp_path: Path) -> None:
    """Mistral with a 16-token window: the check's sequences run past it."""
    _tiny.build("mistral", tmp_path / "mistral", MODELS / "stories260K")
    assert _check(tmp_path / "mistral").contiguous_past


def test_truncate_on_a_group_query_attention_graph(tmp_path: Path) -> None:
    """onnxruntime-genai's model builder output: the graph writes new KV at each row's length."""
    out = tmp_path / "genai"
    source = MODELS / "stories260K-hd32"
    build = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-m", str(source), "-o", str(out), "-p", "fp32", "-e", "cpu"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,  # the builder writes ./cache_dir
    )
    assert build.returncode == 0, build.stderr[-2000:]
    assert _check(out).layout.present == "row"
