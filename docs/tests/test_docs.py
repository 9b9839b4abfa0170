"""Docs stay true: every hook is documented and docs/hooks.md matches the specs (datasette-style)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_hook_docs", ROOT / "scripts" / "gen_hook_docs.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["gen_hook_docs"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_every_hook_has_a_full_docstring() -> None:
    from lmdock import hookspecs

    hooks = [f for n, f in vars(hookspecs).items() if n.startswith("lmdock_")]
    assert len(hooks) >= 6
    for func in hooks:
        doc = func.__doc__ or ""
        assert len(doc.strip().splitlines()) >= 3, f"{func.__name__} needs a summary, when it is called and what it returns"
        assert "Called" in doc, f"{func.__name__}: say when and how often it is called"
        assert ":return:" in doc, f"{func.__name__}: say what it returns"
        if (getattr(func, "lmdock_spec", {}) or {}).get("firstresult"):
            assert "Stops at first non-None result" in doc, func.__name__


def test_hook_reference_is_up_to_date() -> None:
    current = (ROOT / "docs" / "hooks.md").read_text()
    assert current == _generator().render(), "docs/hooks.md is stale: run python scripts/gen_hook_docs.py"


def test_the_authoring_guides_example_spec_passes_the_capability_check() -> None:
    """The spec in docs/authoring-backends.md declares every capability, with a reason where lacking
    (what lmdock-conformance's test_every_capability_is_declared_with_a_reason_when_lacking checks)."""
    import re

    from lmdock.backend import CAPABILITIES

    text = (ROOT / "docs" / "authoring-backends.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "SPEC = BackendSpec(" in b)
    namespace: dict = {}
    exec(block, namespace)  # noqa: S102 - our own documentation
    spec = namespace["SPEC"]
    assert not set(spec.supports) - set(CAPABILITIES)
    for cap in CAPABILITIES:
        ok, reason = spec.capability(cap)
        assert ok or (cap in spec.lacks and reason.strip()), f"the guide's example leaves {cap!r} undeclared"


def test_every_engine_module_is_in_the_engine_guide() -> None:
    """docs/engine.md's table of files names every module of lmdock/_engine/, each with its concern,
    and no module that is gone."""
    import re

    engine = ROOT / "core" / "src" / "lmdock" / "_engine"
    modules = {p.name for p in engine.glob("*.py") if p.name != "__init__.py"}
    assert len(modules) >= 10
    rows = dict(re.findall(r"^\| `(\w+\.py)` \| (.*\S) \|$", (ROOT / "docs" / "engine.md").read_text(), re.M))
    missing = sorted(modules - set(rows))
    assert not missing, f"docs/engine.md: add a row for each module of lmdock/_engine/ and its concern: {missing}"
    stale = sorted(set(rows) - modules)
    assert not stale, f"docs/engine.md names modules that lmdock/_engine/ no longer has: {stale}"


def test_every_server_module_is_in_the_servers_code_map() -> None:
    """docs/server.md's code map names every module of ``lmdock.server`` (read from the folder: the
    docs tests run without the server's extra installed)."""
    text = (ROOT / "docs" / "server.md").read_text()
    modules = sorted(p.name for p in (ROOT / "core" / "src" / "lmdock" / "server").glob("*.py"))
    assert "serving_completion.py" in modules
    missing = [m for m in modules if f"| `{m}` |" not in text]
    assert not missing, f"docs/server.md's code map lacks {', '.join(missing)}: add a row with its one-line concern"


#: Folders mapped in their own guide rather than in docs/code-map.md.
MAPPED_ELSEWHERE = {"_engine": "docs/engine.md", "server": "docs/server.md"}
#: The facade's modules still at the top level while issue 41 moves them into ``_llm/``: counted as ``_llm/``.


def _code_map_sections() -> dict[str, set[str]]:
    """docs/code-map.md's tables: section heading (a folder, or "Top level") -> the entries its rows name."""
    import re

    sections: dict[str, set[str]] = {}
    current = None
    for line in (ROOT / "docs" / "code-map.md").read_text().splitlines():
        heading = re.fullmatch(r"## `?([\w ]+?)/?`?", line)
        if heading:
            current = sections.setdefault(heading.group(1), set())
        elif current is not None and (row := re.match(r"^\| `([\w.]+/?)` \| .*\S \|$", line)):
            current.add(row.group(1))
    return sections


def test_every_folder_of_the_core_is_in_the_code_map() -> None:
    """docs/code-map.md has a table per folder of ``lmdock/`` (but those mapped in their own guide) naming
    every module it has and none that is gone, and a table of the top level's entries."""
    core = ROOT / "core" / "src" / "lmdock"
    sections = _code_map_sections()
    top = {p.name + "/" if p.is_dir() else p.name
           for p in core.iterdir() if p.name != "__pycache__"}
    assert len(top) <= 15, f"the core's top level has {len(top)} entries; group them into folders (issue 41): {sorted(top)}"
    assert sections["Top level"] == top, f"docs/code-map.md's top-level table: add {sorted(top - sections['Top level'])}, " \
                                         f"drop {sorted(sections['Top level'] - top)}"
    for folder in sorted(p for p in core.iterdir() if p.is_dir() and p.name not in {*MAPPED_ELSEWHERE, "__pycache__"}):
        modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        listed = sections.get(folder.name)
        assert listed is not None, f"docs/code-map.md: add a section ## `{folder.name}/` with a row per module"
        assert listed == modules, f"docs/code-map.md's {folder.name}/ table: add {sorted(modules - listed)}, drop {sorted(listed - modules)}"


def test_the_code_map_check_reads_the_tables() -> None:
    sections = _code_map_sections()
    assert {"_plugin", "_config", "_cli", "Top level"} <= set(sections)
    assert "loader.py" in sections["_plugin"] and "_cli/" in sections["Top level"]
