"""What docs/server.md documents and no other test exercised (docs/tests/audit.md points here): the
``--host`` and ``--log-level`` flags of ``lmdock serve`` and ``GET /stats``' fields, on a real server
(stories260K on hf)."""

from __future__ import annotations

from pathlib import Path

import httpx
from serve_helpers import Server


def test_host_and_log_level_flags_and_the_stats_route(tmp_path: Path) -> None:
    """``--host 127.0.0.1`` binds there, over ``[server] host = "127.0.0.2"`` (another loopback
    address); ``--log-level info`` puts uvicorn's info lines in the log (the helper's own
    ``--log-level warning``, which leaves them out, comes first: the last flag wins); ``/stats`` has
    each model's engine counts with the server's ``in_flight``, ``max_queue``, ``state`` and ``memory_bytes``."""
    s = Server(tmp_path, 'max_queue = 7\nhost = "127.0.0.2"\n', args=("--host", "127.0.0.1", "--log-level", "info"))
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 4})
        assert r.status_code == 200
        stats = httpx.get(f"{s.url}/stats").json()["stories"]
        assert stats["max_queue"] == 7 and stats["in_flight"] == 0 and stats["state"] == "loaded"
        assert stats["memory_bytes"] > 0 and stats["num_sequences_held"] == 0
        log = s.output()
        assert "Uvicorn running on http://127.0.0.1:" in log, log[-2000:]
    finally:
        s.stop()


def test_serve_tensor_parallel_size_on_hf_is_refused_naming_it(tmp_path: Path) -> None:
    """``--tensor-parallel-size 2`` reaches lmdock-hf, which runs one model on one device: it refuses,
    and the server never starts."""
    import subprocess
    import sys

    from serve_helpers import models_dir

    exe = Path(sys.executable).with_name("lmdock")
    out = subprocess.run([str(exe), "serve", str(models_dir()), "--backend", "hf", "--tensor-parallel-size", "2", "--port", "0"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode != 0 and "tensor_parallel_size" in out.stderr and "Uvicorn running" not in out.stderr
