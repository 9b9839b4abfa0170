"""Write docs/hooks.md from the docstrings in core/src/lmdock/hookspecs.py (run after editing specs).

`docs/tests/test_docs.py` fails when docs/hooks.md is stale or a hook is undocumented.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

HEADER = """# Hook reference

Generated from `core/src/lmdock/hookspecs.py` by `python scripts/gen_hook_docs.py`; do not edit by
hand. Hooks are listed in lifecycle order. A backend's own hooks (registration, quantization, build
config, loading) are implemented for you by `lmdock.backend.Backend`; implement the others with
`@lmdock.hookimpl` in a module or object that your distribution names in
`[project.entry-points.lmdock]` (see `authoring-backends.md`).
"""


def render() -> str:
    from lmdock import hookspecs

    hooks = [(n, f) for n, f in vars(hookspecs).items() if n.startswith("lmdock_") and callable(f)]
    hooks.sort(key=lambda nf: inspect.getsourcelines(nf[1])[1])
    parts = [HEADER]
    for name, func in hooks:
        opts = getattr(func, "lmdock_spec", {}) or {}
        first = " (firstresult)" if opts.get("firstresult") else ""
        sig = inspect.signature(func)
        parts.append(f"## `{name}`{first}\n\n```python\ndef {name}{str(sig).replace(chr(39), '')}\n```\n\n{inspect.cleandoc(func.__doc__ or '')}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
    out.write_text(render())
    sys.stdout.write(f"wrote {out}\n")
