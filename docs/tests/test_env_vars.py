"""docs/config.md lists every environment variable the code reads or sets (issue 15)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["core/src", "plugins", "contrib", "conformance_tests/src", "benchmarks"]
PATTERN = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(\s*|environ\[\s*|getenv\(\s*)["']([A-Z][A-Z0-9_]+)["']""")


def _variables() -> set[str]:
    found: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            if "/tests/" in path.as_posix() or ".venv" in path.as_posix():
                continue
            found |= set(PATTERN.findall(path.read_text(encoding="utf-8")))
    return found


def test_every_environment_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    variables = _variables()
    assert {"LMDOCK_CONFIG", "LMDOCK_PLUGINS", "LMDOCK_CACHE_DIR"} <= variables  # the pattern finds them
    missing = sorted(v for v in variables if f"`{v}`" not in doc)
    assert not missing, f"docs/config.md (## Environment variables) does not list {missing}"
