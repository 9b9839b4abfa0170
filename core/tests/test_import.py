"""`import lmdock` and `lmdock backends` stay light: no engine, torch or numpy (DESIGN: the core is tiny)."""

from __future__ import annotations

import json
import subprocess
import sys

# the server stack (lmdock[serve]) too: only `lmdock serve` / `import lmdock.server` may import it
HEAVY = ("torch", "numpy", "transformers", "vllm", "mlx", "onnxruntime", "tensorrt_llm",
         "fastapi", "uvicorn", "prometheus_client", "starlette", "pydantic")

PROBE = """
import sys, json
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _heavy_after(body: str) -> list[str]:
    code = PROBE.format(body=body, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_lmdock_imports_nothing_heavy() -> None:
    assert _heavy_after("import lmdock") == []


def test_listing_backends_imports_nothing_heavy() -> None:
    # Loads every installed plugin's entry module (lmdock-hf too, where installed).
    body = "import lmdock._cli.main as c, io, contextlib\nwith contextlib.redirect_stdout(io.StringIO()):\n    c.main(['backends'])"
    assert _heavy_after(body) == []


def test_public_names_are_sorted_and_resolvable() -> None:
    import lmdock

    assert lmdock.__all__ == sorted(lmdock.__all__)
    for name in lmdock.__all__:
        assert getattr(lmdock, name) is not None, name


def test_backend_namespace_is_sorted_resolvable_and_light() -> None:
    import lmdock.backend

    assert lmdock.backend.__all__ == sorted(lmdock.backend.__all__)
    user = set(__import__("lmdock").__all__)
    # authors' names live in lmdock.backend; lmdock keeps what users call
    assert {"BackendSpec", "StepEngine", "SeqChunk", "SlotTable", "Sampler"}.isdisjoint(user)
    assert _heavy_after("import lmdock.backend as b; b.BackendSpec; b.StepEngine") == []
