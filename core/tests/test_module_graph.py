"""The core's modules stay a clean graph: no import cycle, folders that import each other only in the
directions allowed below, and no module reading another's private names.

Both checks read the source (``ast``), so they need no import and see every module, lazy ones included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "lmdock"
#: Modules checked for reading another module's private names: the whole core (issue 27).
PRIVATE_NAMES_CHECKED = ("lmdock",)
#: Underscored names that are other libraries' documented public API.
NOT_PRIVATE = {"_exit"}  # os._exit: documented; the CLI leaves with it after Ctrl-C


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module level, in ``if`` and ``try`` blocks too (``if TYPE_CHECKING:`` included: a
    cycle of type-only imports is still a circle of concepts); imports inside functions are lazy."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)


def _resolve(name: str, node: ast.ImportFrom | ast.Import, alias: ast.alias) -> list[str]:
    """The lmdock modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        target = alias.name
        return [target] if target in MODULES else []
    base = node.module or ""
    if node.level:
        package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    full = f"{base}.{alias.name}"
    if full in MODULES:  # ``from lmdock._engine import runner``
        return [full]
    return [base] if base in MODULES else []


def _imports(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: set[str] = set()
    for node in _module_level(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found.update(_resolve(name, node, alias))
    found.discard(name)
    return found


def _all_imports(name: str) -> set[str]:
    """Every lmdock module ``name`` imports, lazy (in functions) and type-only imports included."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found.update(_resolve(name, node, alias))
    found.discard(name)
    return found


#: The facade's modules that still sit at the top level while issue 41 moves them into ``_llm/``: counted as ``_llm``.
#: The floor: every folder may raise the core's errors.
FLOOR = "lmdock._plugin.errors"

#: Which part of the core may import which (lazy and type-only imports included); docs/code-map.md draws it.
#: A part is a folder of ``lmdock/``, a top-level module (``backend``, ``hookspecs``, ``__main__``) or ``lmdock``
#: (the package's ``__init__``).  A new arrow is a design decision: add it here with its reason.
ALLOWED: dict[str, set[str]] = {
    # configuration types: below everything but a parser's name (tools, checked lazily) and LoRA adapter names (_llm)
    "_config": {"tools", "_llm"},
    # the tiny core: the contract types its calls with the facade's requests and outputs; the built-in plugin
    # and the loader build the engine
    "_plugin": {"_config", "_engine", "_llm", "hookspecs"},
    "hookspecs": {"_config", "_engine", "_plugin"},
    "backend": {"_config", "_engine", "_llm", "_plugin"},
    # the step loop: reports through the facade's sinks and outputs, detokenizes with its tokenizer
    "_engine": {"_config", "_plugin", "_llm"},
    "_grammar": {"_config", "_engine"},
    "tools": {"_config", "_plugin"},
    # the facade: loads through _plugin, checks grammars in _grammar, writes batch lines through _openai
    "_llm": {"_config", "_engine", "_grammar", "_openai", "_plugin", "tools"},
    # OpenAI's wire shapes: the chat prompt types of the facade (an arrow back to _llm)
    "_openai": {"_config", "_llm"},
    "_models": {"_config", "_llm"},
    # the server: a client of the facade, the model pool and the wire shapes; the Ray front end's engine is a
    # request engine (lmdock.backend's base)
    "server": {"lmdock", "_config", "_llm", "_models", "_openai", "_plugin", "tools", "backend"},
    "_cli": {"lmdock", "_config", "_llm", "_plugin", "server"},
    "lmdock": {"_config", "_llm", "_models", "_plugin", "backend"},
    "__main__": {"_cli"},
}


def part(module: str) -> str:
    """The part of the core ``module`` belongs to (see ALLOWED)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "lmdock"
    return parts[1]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_import_graph_is_read() -> None:
    assert "lmdock._engine.runner" in MODULES and "lmdock" in MODULES
    assert "lmdock._engine.scheduler" in _imports("lmdock._engine.runner")


def test_the_core_has_no_import_cycle() -> None:
    graph = {name: _imports(name) for name in MODULES}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_every_part_of_the_core_is_in_the_allowed_table() -> None:
    """A new folder or top-level module gets its row (what it may import, and why) when it is created."""
    parts = {part(m) for m in MODULES} - {"lmdock"}
    assert not parts - set(ALLOWED), f"add a row to ALLOWED for {sorted(parts - set(ALLOWED))}"
    assert not set(ALLOWED) - parts - {"lmdock"}, f"ALLOWED names parts that are gone: {sorted(set(ALLOWED) - parts)}"


def test_folders_import_each_other_only_in_the_allowed_directions() -> None:
    wrong = sorted(f"{m} -> {t}" for m in MODULES for t in _all_imports(m)
                   if t != FLOOR and part(m) != part(t) and part(t) not in ALLOWED.get(part(m), set()))
    assert not wrong, "imports across folders that ALLOWED does not allow (add the arrow with its reason, or move the code):\n" + "\n".join(wrong)


def test_the_direction_check_sees_a_wrong_arrow() -> None:
    assert "_cli" not in ALLOWED["_config"] and part("lmdock._cli.main") == "_cli"
    assert part("lmdock._config.model") == "_config" and part("lmdock") == "lmdock" and part("lmdock._llm.lora") == "_llm"


def test_the_cycle_finder_finds_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _defined_here(tree: ast.Module) -> set[str]:
    """Private names this module defines: functions, classes, attributes it assigns, ``__slots__``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # ``__slots__`` entries, ``getattr(x, "_name")``
    return {n for n in names if _private(n)}


def private_reads(path: Path) -> list[str]:
    """``file:line name`` for each private name this module reads (or sets) but does not define: an
    attribute ``x._name`` of another module's object, or ``from module import _name``.  Private *modules*
    (``lmdock._engine``) are the norm and not counted."""
    tree = ast.parse(path.read_text(), str(path))
    mine = _defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in mine | NOT_PRIVATE:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmdock"):
            for alias in node.names:
                if _private(alias.name) and f"{node.module}.{alias.name}" not in MODULES:
                    found.append((node.lineno, alias.name))
    return [f"{path.relative_to(SRC)}:{line} {name}" for line, name in sorted(found)]


@pytest.mark.parametrize("scope", PRIVATE_NAMES_CHECKED)
def test_no_module_reads_another_modules_private_names(scope: str) -> None:
    checked = [p for m, p in MODULES.items() if m == scope or m.startswith(scope + ".")]
    assert checked
    offenders = [hit for path in checked for hit in private_reads(path)]
    assert not offenders, "private names read from another module:\n" + "\n".join(offenders)


def test_the_private_name_check_sees_a_read(tmp_path: Path) -> None:
    src = tmp_path / "lmdock" / "m.py"
    src.parent.mkdir()
    src.write_text(
        "from lmdock._engine.runner import _helper\n"
        "class A:\n    def __init__(self):\n        self._mine = 1\n    def f(self, other):\n"
        "        other._set = 1\n"
        "        return self._mine + other._mine + other.cache._kv\n"
    )
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        assert private_reads(src) == ["lmdock/m.py:1 _helper", "lmdock/m.py:6 _set", "lmdock/m.py:7 _kv"]
    finally:
        SRC = saved
