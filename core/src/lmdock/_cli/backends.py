"""``lmdock backends``: the installed backends, their state, engines and capabilities."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    """``lmdock backends``'s flags."""
    b = sub.add_parser("backends", help="list installed backends, their state and capabilities")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmdock._plugin.manager import plugin_filter_note

    rows, engine_lines = _backend_rows()
    note = plugin_filter_note()
    if note:
        print(f"lmdock: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_backends(rows, engine_lines, note)
    sys.stdout.flush()  # the warnings come last, under the table, where the eye lands
    for r in rows:  # an engine outside its tested range: a warning, not a refusal (issue 26)
        for warning in r["warnings"]:
            print(f"lmdock: warning: {warning}", file=sys.stderr)
    return 0


def _print_backends(rows: list[dict[str, Any]], engine_lines: list[list[str]], note: str | None) -> None:
    if not rows:
        if note is None:
            print("no backends installed; pip install lmdock-hf (or lmdock-onnx, lmdock-mlx, lmdock-vllm, lmdock-trtllm)")
        else:
            print("no backends loaded")
        return
    print(f"{'BACKEND':<10} {'PACKAGE':<16} {'VERSION':<9} {'KIND':<8} STATUS")
    for r, lines in zip(rows, engine_lines):
        status = r["status"] if r["reason"] is None else f"{r['status']}: {r['reason']}"
        if r.get("engine"):
            status += f" ({r['engine']})"
        print(f"{r['name']:<10} {r['package'] or '-':<16} {r['version'] or '-':<9} {r['kind'] or '-':<8} {status}")
        for line in lines:
            print(f"{'':<10} engine: {line}")
        if r["capabilities"]:
            print(f"{'':<10} supports: {', '.join(r['capabilities'])}")


def _backend_rows() -> tuple[list[dict[str, Any]], list[list[str]]]:
    """``lmdock backends --json``'s rows, and each row's "engine:" lines for the text listing."""
    from lmdock._plugin.contract import CAPABILITIES
    from lmdock._plugin.manager import get_registry
    from lmdock._plugin.versions import report

    reg = get_registry()
    rows: list[dict[str, Any]] = []
    engine_lines: list[list[str]] = []
    for spec in sorted(reg.backends.values(), key=lambda s: s.name):
        reason = spec.available()
        engines, warnings = report(spec)
        rows.append({
            "name": spec.name, "plugin": spec.plugin, "package": spec.package, "version": spec.version, "kind": spec.kind,
            "status": "available" if reason is None else "unavailable", "reason": reason,
            "engine": spec.engine_info() if reason is None else None,
            "engine_packages": [e.as_json() for e in engines], "warnings": warnings,
            "capabilities": sorted(c for c in CAPABILITIES if c in spec.supports),
            "lacks": {c: spec.capability(c)[1] for c in CAPABILITIES if c not in spec.supports},
        })
        engine_lines.append([e.describe() for e in engines if e.version is not None])
    for b in sorted(reg.broken.values(), key=lambda b: b.name):
        rows.append({"name": b.name, "plugin": b.name, "package": b.distribution, "version": None, "kind": None,
                     "status": "broken", "reason": b.error, "engine_packages": [], "warnings": [],
                     "capabilities": [], "lacks": {}})
        engine_lines.append([])
    return rows, engine_lines
