"""The real agent CLIs, unmodified, against ``lmdock serve`` (127.0.0.1) on the planted model
(planted.py): the first turn calls a tool, the CLI runs it and sends the result back, and the answer
after the result is a fixed sentence.  Each CLI must finish a complete tool turn and exit 0.

Only telemetry, update checks, nonessential traffic and Codex's plugin sync are switched off; HOME and the working
directory are temporary directories, the API keys dummies."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import planted
from recorder import Recorder

SENTENCE = "".join(planted.SENTENCE)
QUIET = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
         "DISABLE_ERROR_REPORTING": "1"}
CODEX_CONFIG = """model = "planted"
model_provider = "lmdock"
check_for_update_on_startup = false

[model_providers.lmdock]
name = "lmdock"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "LMDOCK_API_KEY"

[analytics]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
"""


def run(argv: list[str], tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    base = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return subprocess.run(argv, cwd=work, env={**base, "HOME": str(home), "TMPDIR": str(tmp), **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, check=False)


def requests_to(recorder: Recorder, path: str) -> list[dict[str, Any]]:
    return [body for p, body in recorder.bodies if p.split("?")[0] == path and isinstance(body, dict)]


def test_claude_code_completes_a_tool_turn(fresh: Recorder, claude: Path, tmp_path: Path) -> None:
    env = {**QUIET, "ANTHROPIC_BASE_URL": fresh.url, "ANTHROPIC_API_KEY": "dummy", "ANTHROPIC_MODEL": "planted",
           "ANTHROPIC_SMALL_FAST_MODEL": "planted"}
    done = run([str(claude), "-p", "Show me /etc/hostname.", "--output-format", "json"], tmp_path, env)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result = json.loads(done.stdout)
    assert result["result"] == SENTENCE and result["is_error"] is False, result
    assert result["num_turns"] >= 2, result
    turns = requests_to(fresh, "/v1/messages")
    calls = [b for body in turns for m in body["messages"] if m["role"] == "assistant" and isinstance(m["content"], list)
             for b in m["content"] if b["type"] == "tool_use"]
    results = [b for body in turns for m in body["messages"] if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_result"]
    assert any(c["name"] == "Read" and c["input"] == planted.CLAUDE_ARGS for c in calls), turns[-1]["messages"]
    assert {r["tool_use_id"] for r in results} & {c["id"] for c in calls}, turns[-1]["messages"]


def test_codex_completes_a_tool_turn(fresh: Recorder, codex: Path, tmp_path: Path) -> None:
    home = tmp_path / "codex_home"
    home.mkdir()
    (home / "config.toml").write_text(CODEX_CONFIG.format(url=fresh.url), encoding="utf-8")
    env = {"CODEX_HOME": str(home), "LMDOCK_API_KEY": "dummy"}
    done = run([str(codex), "exec", "--skip-git-repo-check", "Echo something."], tmp_path, env)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.stdout.strip().splitlines()[-1] == SENTENCE, done.stdout
    turns = requests_to(fresh, "/v1/responses")
    items = [i for body in turns if isinstance(body["input"], list) for i in body["input"]]
    calls = [i for i in items if i.get("type") == "function_call"]
    outputs = [i for i in items if i.get("type") == "function_call_output"]
    assert any(c["name"] == "exec_command" and json.loads(c["arguments"]) == planted.CODEX_ARGS for c in calls), items
    assert {o["call_id"] for o in outputs} & {c["call_id"] for c in calls}, items
    assert any("planted-echo" in json.dumps(o["output"]) for o in outputs), outputs
