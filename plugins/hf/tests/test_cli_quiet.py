"""A `lmdock` run shows the answer, not transformers' "Loading weights" bar or its token-length
warning (issue 15)."""

from __future__ import annotations

import os
import subprocess
import sys

from stories_facts import stories_path


def _lmdock(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    return subprocess.run([sys.executable, "-m", "lmdock", *args], capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)


def test_generate_prints_no_loading_bar() -> None:
    out = _lmdock("generate", "-m", stories_path(), "--backend", "hf", "--max-new-tokens", "3", "--temperature", "0", "Once upon a time")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "Loading weights" not in out.stderr
    assert out.stderr == ""


def test_too_long_prompt_gives_lmdock_error_without_transformers_warning() -> None:
    out = _lmdock("generate", "-m", stories_path(), "--backend", "hf", "--max-new-tokens", "3", "Once upon a time " * 200)
    assert "Token indices sequence length" not in out.stderr
    assert out.returncode == 2 and out.stderr.startswith("lmdock: error:"), out.stderr
