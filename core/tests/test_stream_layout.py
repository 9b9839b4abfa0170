"""Issue 41's shape, read from the source (``ast``): one stream from the engine thread to its readers
(``lmdock._llm.streams``), and a server that reaches the engine only through the ``LLM``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lmdock"
#: The Ray replica is an engine itself (it re-exposes its LLM's engine to the front end), so it reads
#: the engine's facts; no route does.
ENGINE_BRIDGES = {"_ray.py"}


def _attribute_reads(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == name]


def test_the_server_never_touches_llm_engine() -> None:
    hits = [f"{p.name}:{line}" for p in sorted((PACKAGE / "server").glob("*.py")) if p.name not in ENGINE_BRIDGES
            for line in _attribute_reads(p, "engine")]
    assert not hits, "the server reads .engine (use the LLM's calls: make_request, open_stream...): " + ", ".join(hits)


def test_only_the_request_stream_hands_outputs_across_threads() -> None:
    # call_soon_threadsafe is how an engine thread's output reaches an event loop: one place does it
    hits = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")) if _attribute_reads(p, "call_soon_threadsafe")]
    assert hits == ["_llm/streams.py"]


def test_the_check_sees_a_read(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f(sm):\n    return sm.llm.engine.submit\n")
    assert _attribute_reads(src, "engine") == [2]
