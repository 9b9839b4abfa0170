"""The core reads an engine's (and a scheduler's) members directly: their kinds and optional members
are declared on ``lmdock.backend``'s base classes, and an engine or scheduler written without them is
adapted once, in ``lmdock._engine.adapters`` (issue 41).  So no ``hasattr``/``getattr`` whose first
argument names an engine, a draft engine or a scheduler appears anywhere else in the core.  And no core
module grows past 450 lines.

Both read the source (``ast``, line counts): they need no import and see every module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "lmdock"
#: the one module that may look at which members an engine or a scheduler has
ADAPTERS = PACKAGE / "_engine" / "adapters.py"
#: a name in the probed expression that says it is an engine or a scheduler
ENGINE_NAMES = re.compile(r"engine|draft|scheduler", re.IGNORECASE)
#: the most lines a core module may have
MAX_LINES = 450


def _names(node: ast.expr) -> list[str]:
    """The identifiers an expression is built from (``self.llm.engine``: self, llm, engine)."""
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.append(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.append(sub.attr)
    return out


def probes(path: Path, root: Path = SRC) -> list[str]:
    """``file:line call(first argument)`` for each ``hasattr``/``getattr`` of an engine or scheduler
    (``file`` relative to ``root``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and node.args and any(ENGINE_NAMES.search(n) for n in _names(node.args[0]))):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
    return found


def test_no_hasattr_or_getattr_of_an_engine_outside_the_adapters() -> None:
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != ADAPTERS for hit in probes(path)]
    assert not offenders, ("an engine or scheduler probed for its members (declare the member on its base class in "
                           "lmdock.backend, with a default, and read it directly):\n" + "\n".join(offenders))


def test_the_probe_check_sees_a_probe(tmp_path: Path) -> None:
    src = tmp_path / "lmdock" / "m.py"
    src.parent.mkdir()
    src.write_text(
        "def f(llm, engine, draft, tok):\n"
        "    a = hasattr(engine, 'pool')\n"
        "    b = getattr(getattr(llm.engine, 'inner', None), 'n', None)\n"
        "    c = hasattr(self.scheduler, 'capacity') or hasattr(draft, 'step')\n"
        "    return getattr(tok, 'chat_template', None)\n"  # a tokenizer: not an engine
    )
    assert probes(src, root=tmp_path) == [
        "lmdock/m.py:2 hasattr(engine, ...)",
        "lmdock/m.py:3 getattr(getattr(llm.engine, 'inner', None), ...)",
        "lmdock/m.py:3 getattr(llm.engine, ...)",
        "lmdock/m.py:4 hasattr(self.scheduler, ...)",
        "lmdock/m.py:4 hasattr(draft, ...)",
    ]


def test_the_adapters_are_where_the_check_exempts() -> None:
    assert ADAPTERS.exists() and probes(ADAPTERS), "the adapters module moved: point ADAPTERS at it"


def test_no_core_module_is_over_450_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in sorted(PACKAGE.rglob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"core modules over {MAX_LINES} lines (split them by concern): {long}"
