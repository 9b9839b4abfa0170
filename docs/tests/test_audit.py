"""Every documented feature has a test (issue 39): what ``docs/`` names is read from the places that name
it, and ``docs/tests/audit.md`` maps each to the test that exercises it; this fails when a documented
name has no row, or its row's test does not exist or does not mention the name.

What is read (backticked or TOML names in specific sections, so the list is precise, not noisy):

- **config keys**: every key of a ``toml`` code block in ``docs/**/*.md`` that the config schema
  (``lmdock config schema``) knows, by its table: ``server.max_n``, ``build.max_seq_len``,
  ``model.keep_alive`` (a ``[models.NAME]`` key), ``backends.hf.num_threads``;
- **CLI flags**: every backticked ``--flag`` in ``docs/cli.md`` and ``docs/server.md``;
- **routes**: the first column of ``docs/server.md``'s route table (``POST /v1/completions``);
- **request fields**: the first column of ``docs/server.md``'s ``| field |`` tables;
- **structured-output syntaxes**: the first column of ``docs/structured-output.md``'s tables of
  ``structured_output`` fields and of the request fields that set them.

A row names a test as ``path::function`` (path from the repository root); "mentions" means the
function's source, decorators included, holds the name (for a config key its last part, for a route
its path).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
AUDIT = DOCS / "tests" / "audit.md"


# -- what docs/ names ------------------------------------------------------------------------------


def _table_of(header: str) -> str | None:
    """A TOML table header as the audit names it: ``server``, ``model`` (``[models.NAME]``), ``build``
    (``[models.NAME.build]``), ``backends.hf``, ``top``; None for tables that are not lmdock's."""
    p = header.split(".")
    if header == "":
        return "top"
    if p[0] == "server" and len(p) == 1:
        return "server"
    if p[0] != "models" or len(p) < 2:
        return None
    if len(p) == 2:
        return "model"
    if p[2] == "backends" and len(p) == 4:
        return f"backends.{p[3]}"
    return p[2] if len(p) == 3 and p[2] != "adapters" else None


def _schema_knows(table: str, key: str) -> bool:
    from lmdock._config.file import config_schema

    schema = config_schema()
    props = schema["properties"]
    model = props["models"]["additionalProperties"]["properties"]
    if table == "top":
        return key in props and key not in ("server", "models")
    if table == "server":
        return key in props["server"]["properties"]
    if table == "model":
        return key in model
    if table.startswith("backends."):
        return table.split(".", 1)[1] in model.get("backends", {}).get("properties", {})
    return key in model.get(table, {}).get("properties", {})


def config_keys() -> set[str]:
    keys = set()
    for md in sorted(DOCS.rglob("*.md")):
        for block in re.findall(r"```toml\n(.*?)```", md.read_text(encoding="utf-8"), re.S):
            table: str | None = "top"
            for line in block.splitlines():
                line = line.split("#", 1)[0].rstrip()
                header = re.match(r"\s*\[+([^\]]+)\]+\s*$", line)
                if header:
                    table = _table_of(header.group(1).strip())
                    continue
                key = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=", line)
                if key and table is not None and _schema_knows(table, key.group(1)):
                    keys.add(f"{table}.{key.group(1)}")
    return keys


def cli_flags() -> set[str]:
    text = "".join((DOCS / name).read_text(encoding="utf-8") for name in ("cli.md", "server.md"))
    return set(re.findall(r"`(--[a-z][a-z0-9-]*)(?=[`\s=])", text))  # not `--model_args` (lm_eval's)


def _first_column(text: str, header: str) -> list[str]:
    """The first cells of every table whose header row starts with ``header``."""
    cells = []
    for table in re.findall(rf"^\| {re.escape(header)} \|.*\n\|[- |]+\|\n((?:\|.*\n)+)", text, re.M):
        cells += [row.split("|")[1] for row in table.splitlines()]
    return cells


def routes() -> set[str]:
    text = (DOCS / "server.md").read_text(encoding="utf-8")
    found = set()
    for cell in _first_column(text, "route"):
        found |= {f"{m} {p}" for m, p in re.findall(r"`(GET|POST|HEAD|DELETE) (/[^`]*)`", cell)}
        for first, second, path in re.findall(r"`(GET|POST|HEAD|DELETE)`/`(GET|POST|HEAD|DELETE) (/[^`]*)`", cell):
            found |= {f"{first} {path}", f"{second} {path}"}  # `GET`/`DELETE /path`
    return found


def request_fields() -> set[str]:
    text = (DOCS / "server.md").read_text(encoding="utf-8")
    return {name for cell in _first_column(text, "field") for name in re.findall(r"`([a-z_]+)`", cell)[:1]}


def syntaxes() -> set[str]:
    text = (DOCS / "structured-output.md").read_text(encoding="utf-8")
    names = {name for cell in _first_column(text, "field") for name in re.findall(r"`([a-z_]+)`", cell)[:1]}
    for cell in _first_column(text, "request field"):
        names |= set(re.findall(r"`(guided_[a-z]+|structured_outputs|response_format)", cell))
    return names


def documented() -> dict[str, set[str]]:
    """What docs/ names, by kind."""
    return {"config": config_keys(), "cli": cli_flags(), "route": routes(), "field": request_fields(), "syntax": syntaxes()}


# -- the audit table -------------------------------------------------------------------------------


def audit_rows() -> dict[tuple[str, str], str]:
    """``(kind, name) -> "path::function"`` from docs/tests/audit.md's table rows."""
    rows = {}
    for kind, name, test in re.findall(r"^\| (\w+) \| `([^`]+)` \| `([^`]+)` \|", AUDIT.read_text(encoding="utf-8"), re.M):
        rows[(kind, name)] = test
    return rows


def needle(kind: str, name: str) -> str:
    """What a test must mention for a name: a config key's last part, anything else as written
    (a route: see :func:`mentions`)."""
    return name.rsplit(".", 1)[1] if kind == "config" else name


def mentions(kind: str, name: str, source: str) -> bool:
    """Whether a test's source mentions a documented name: as a whole word, a config key with its
    table's name (``kv_cache``, ``server``: case aside) unless it is a ``[models.NAME]`` or top-level
    key.  A route: its path, where ``{id}`` is any
    segment (``/v1/models/stories/load``, or an f-string's ``{name}``), and a method other than GET
    and POST by name (``delete``, ``head``)."""
    source = source.replace("\\n", " ")  # a TOML line in a Python string: "...\nkey = 1"
    if kind == "config":  # the key's table too (kv_cache.max_tokens is not the request's max_tokens)
        table = name.rsplit(".", 1)[0].split(".")[-1]
        if table not in ("top", "model") and table.lower() not in source.lower():
            return False
    if kind != "route":  # a whole name: max_n is not in max_num_seqs
        return re.search(rf"(?<![\w-]){re.escape(needle(kind, name))}(?![\w-])", source) is not None
    method, path = name.split(" ", 1)
    pattern = "[^/\"' ]+".join(re.escape(part) for part in re.split(r"\{[^}]+\}", path))
    if re.search(pattern + "(?![\\w/])", source) is None:
        return False
    return method in ("GET", "POST") or method.lower() in source.lower()


@cache
def functions(path: Path) -> dict[str, str]:
    """Each test function's source (decorators included) in a file, by name."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            out[node.name] = "\n".join(lines[start - 1:node.end_lineno])
    return out


def problems() -> list[str]:
    rows = audit_rows()
    out = []
    for kind, names in documented().items():
        for name in sorted(names):
            test = rows.get((kind, name))
            if test is None:
                out.append(f"{kind} `{name}`: no row in docs/tests/audit.md")
                continue
            path, _, func = test.partition("::")
            if not (ROOT / path).is_file():
                out.append(f"{kind} `{name}`: {path} does not exist")
                continue
            source = functions(ROOT / path).get(func)
            if source is None:
                out.append(f"{kind} `{name}`: {path} has no function {func}")
            elif not mentions(kind, name, source):
                out.append(f"{kind} `{name}`: {test} does not mention it")
    return out


def test_the_extraction_finds_what_the_docs_name() -> None:
    """The readers are not silently empty: known names of each kind are found, foreign ones are not."""
    found = documented()
    assert {"server.max_n", "server.response_store_max_bytes", "build.max_seq_len", "model.keep_alive"} <= found["config"]
    assert "top.model_provider" not in found["config"]  # Codex's config.toml, in a toml block, is not lmdock's
    assert {"--api-key", "--chat-template", "--served-model-name"} <= found["cli"]
    assert {"POST /v1/completions", "POST /v1/messages", "GET /health", "DELETE /v1/responses/{id}"} <= found["route"]
    assert {"logit_bias", "guided_grammar", "response_format"} <= found["field"]
    assert {"json", "regex", "choice", "grammar", "guided_json"} <= found["syntax"]


def test_every_documented_name_has_a_test_that_mentions_it() -> None:
    missing = problems()
    assert not missing, "documented without a test (add a row to docs/tests/audit.md, or a test):\n" + "\n".join(missing)


def test_every_row_names_something_documented() -> None:
    """No stale rows: a row whose name the docs no longer name goes."""
    found = documented()
    stale = [f"{k} `{n}`" for (k, n) in audit_rows() if n not in found.get(k, set())]
    assert not stale, "rows for names docs/ no longer names: " + ", ".join(stale)
